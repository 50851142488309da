"""shapes.max_cuda_graphs: the budget that decides which shape signatures record a CUDA graph.

CUDA graphs themselves need a GPU (tests/gpu checks them end to end); what is checked here, on
any machine, is the contract with torch the budget relies on: torch's CUDA graph trees ask
`is_cudagraph_capture_sizes(int_key)` before recording or replaying, and inside a Kiln call that
question reaches the budget, which answers per signature, never beyond its bound.
"""
import logging

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.cudagraph_trees import is_cudagraph_capture_sizes  # what torch asks (2.11 - 2.13)

from kiln.compiler.torch_compat import cuda_graph_trees
from kiln.compiler.shapes.cuda_graph_budget import NOT_ASKED, OVER_BOUND, RECORDED, CudaGraphBudget
from kiln.compiler.stats import VariantRecord


def _record(batch: int) -> VariantRecord:
    return VariantRecord(graph=0, signature=f"batch {batch}, latent 8x8 (64x64 px)", how="reused", seconds=0.0)


def _torch_asks(int_key):
    return is_cudagraph_capture_sizes(int_key)


def test_the_first_signatures_record_up_to_the_bound_and_the_rest_say_why_not(caplog):
    budget = CudaGraphBudget(limit=2)
    first, second, third = _record(2), _record(4), _record(6)
    with caplog.at_level(logging.INFO, logger="kiln"):
        assert budget.run(first, _torch_asks, ((2, 8),)) is True
        assert budget.run(second, _torch_asks, ((4, 8),)) is True
        assert budget.run(third, _torch_asks, ((6, 8),)) is False  # over the bound: runs without a graph
        assert budget.run(first, _torch_asks, ((2, 8),)) is True    # its recording still replays
        assert budget.run(third, _torch_asks, ((6, 8),)) is False
    assert (first.cuda_graph, second.cuda_graph, third.cuda_graph) == (RECORDED, RECORDED, OVER_BOUND)
    assert budget.recorded == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "batch 6" in warnings[0] and "max_cuda_graphs" in warnings[0]


def test_the_gate_is_scoped_to_kiln_calls():
    budget = CudaGraphBudget(limit=0)
    record = _record(2)
    assert budget.run(record, _torch_asks, ((2, 8),)) is False
    assert inductor_config.triton.cudagraph_capture_sizes is None  # global config untouched
    assert is_cudagraph_capture_sizes((2, 8))                       # other models: torch's default


def test_a_graph_torch_never_cuda_graphs_is_reported_as_such():
    budget = CudaGraphBudget(limit=4)
    record = _record(2)
    assert budget.run(record, lambda x: x + 1, (1,)) == 2
    assert record.cuda_graph == NOT_ASKED and budget.recorded == 0


def test_a_failing_call_leaves_the_budget_clean():
    budget = CudaGraphBudget(limit=1)

    def fails(_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        budget.run(_record(2), fails, (0,))
    assert inductor_config.triton.cudagraph_capture_sizes is None and budget.recorded == 0
    later = _record(4)
    assert budget.run(later, _torch_asks, ((4, 8),)) is True and later.cuda_graph == RECORDED


def _region_record(graph: int, latent: int) -> VariantRecord:
    return VariantRecord(graph=graph, signature=f"latent {latent}x{latent}", how="reused", seconds=0.0)


def test_inside_a_model_call_the_place_is_the_models_input_shape(caplog):
    """A model compiled by blocks runs a graph per region at each of its sizes: they all record under
    the call's input shape, which takes one place, so the bound counts shapes a user samples."""
    budget = CudaGraphBudget(limit=2)
    shapes = {batch: ((batch, 4, 64, 64), (batch,)) for batch in (2, 4, 6)}
    records = {batch: [_region_record(graph, latent) for graph, latent in ((0, 64), (1, 32), (2, 16))]
               for batch in shapes}
    with caplog.at_level(logging.INFO, logger="kiln"):
        for batch in (2, 4, 6, 2, 6):
            with budget.for_call(shapes[batch]):
                answers = [budget.run(record, _torch_asks, ((batch, record.graph),)) for record in records[batch]]
            assert answers == [batch != 6] * 3, batch
    assert budget.shapes == [shapes[2], shapes[4]] and budget.recorded == 2
    assert all(r.cuda_graph == RECORDED for batch in (2, 4) for r in records[batch])
    assert all(r.cuda_graph == OVER_BOUND for r in records[6])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "input shape 6x4x64x64, 6" in warnings[0], warnings


def test_graphs_run_outside_a_model_call_count_one_place_each():
    budget = CudaGraphBudget(limit=2)
    with budget.for_call(((2, 4, 8, 8),)):
        assert budget.run(_record(2), _torch_asks, ((2, 8),)) is True
    outside = _record(4)
    assert budget.run(outside, _torch_asks, ((4, 8),)) is True
    assert budget.run(outside, _torch_asks, ((4, 8),)) is True   # replays: no new place
    assert budget.run(_record(6), _torch_asks, ((6, 8),)) is False
    with budget.for_call(((4, 4, 8, 8),)):
        assert budget.run(_record(8), _torch_asks, ((8, 8),)) is False
    assert budget.recorded == 2


def _trees_generation() -> int:
    """The step number torch's CUDA graph trees read before every call of a CUDA-graphed function
    (`CUDAGraphTreeManager.get_curr_generation`, torch 2.11, 2.13): a new number starts a new step,
    and a new step may reuse the memory of every output of the last."""
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    return CUDAGraphTreeManager.get_curr_generation()


def _torch_generation() -> int:
    from torch._dynamo.mutation_guard import GenerationTracker

    return GenerationTracker.generation


def _enter_compiled_code() -> None:
    """What every entry into compiled code from eager code does for the trees (TorchDynamo's
    `GenerationTracker.generation += 1`, torch 2.11, 2.13): by blocks, every region call."""
    from torch._dynamo.mutation_guard import GenerationTracker

    GenerationTracker.generation += 1


def test_a_model_call_is_one_step_of_the_cuda_graph_trees():
    """By blocks, every region's compiled graph is entered from eager code, which by torch's default
    starts a new step each time and lets the next region's replay overwrite a skip connection
    (seen on an H200: "accessing tensor output of CUDAGraphs that has been overwritten"). Inside a
    model call the step stays the same for every graph; each call is a new step; after the call,
    torch's own rule is back for other code."""
    before = _trees_generation()
    _enter_compiled_code()
    assert _trees_generation() != before  # torch's rule outside a Kiln call: each entry a new step
    budget = CudaGraphBudget(limit=4)
    outside = _trees_generation()
    seen = []
    for shape in ((2, 8), (2, 8)):
        with budget.for_call(shape):
            first = _trees_generation()
            _enter_compiled_code()  # a region
            _enter_compiled_code()  # the next region
            seen.append((first, _trees_generation()))
        assert _trees_generation() == _torch_generation()  # after the call: torch's own numbering again
    (a_first, a_last), (b_first, b_last) = seen
    assert a_first == a_last and b_first == b_last   # one step through each call, however many graphs
    assert len({a_first, b_first, outside}) == 3     # a new step per call
    assert a_first <= cuda_graph_trees.KILN_STEPS_FROM and b_first <= cuda_graph_trees.KILN_STEPS_FROM  # Kiln's numbers, not torch's


def test_the_step_marker_is_put_back_when_the_call_fails():
    budget = CudaGraphBudget(limit=4)
    outside = _trees_generation()
    with pytest.raises(RuntimeError, match="boom"):
        with budget.for_call((2, 8)):
            assert _trees_generation() != outside
            raise RuntimeError("boom")
    assert _trees_generation() == outside


def test_a_model_called_inside_another_models_call_stays_in_the_outer_step():
    outer, inner = CudaGraphBudget(limit=4), CudaGraphBudget(limit=4)
    with outer.for_call((2, 8)):
        step = _trees_generation()
        with inner.for_call((1, 8)):
            assert _trees_generation() == step
        assert _trees_generation() == step


def test_a_cuda_graphed_calls_outputs_are_copies_of_its_own(caplog):
    """A step of torch's CUDA graph trees may reuse the memory of the last step's outputs: the whole
    SDXL UNet's output, kept while the next call ran, could no longer be read ("accessing tensor output
    of CUDAGraphs that has been overwritten", seen on an H100). Each tensor handed back is a copy;
    anything else is handed back as it is; an output with no tensor Kiln can find is said, once."""
    budget = CudaGraphBudget(limit=2)
    latent, extra = torch.ones(2, 4), torch.zeros(3)
    copy, extras, listed, name = budget.owned((latent, {"extra": extra, "steps": 4}, [latent], "name"))
    assert torch.equal(copy, latent) and copy.data_ptr() != latent.data_ptr()
    assert torch.equal(extras["extra"], extra) and extras["extra"].data_ptr() != extra.data_ptr()
    assert extras["steps"] == 4 and name == "name" and listed[0].data_ptr() != latent.data_ptr()

    class Unknown:  # a container torch's pytree does not know
        def __init__(self, sample):
            self.sample = sample

    with caplog.at_level(logging.WARNING, logger="kiln"):
        for _ in range(2):
            kept = Unknown(latent)
            assert budget.owned(kept) is kept
    said = [r.getMessage() for r in caplog.records if "holds no tensor" in r.getMessage()]
    assert len(said) == 1 and "Unknown" in said[0]


class _HandsBackItsInput(torch.nn.Module):
    def forward(self, x):
        return x, x * 2


def test_a_model_with_cuda_graphs_on_hands_back_outputs_copied_inside_its_step(monkeypatch):
    import kiln

    copied_in = []
    owned = CudaGraphBudget.owned

    def observed(self, outputs):
        copied_in.append(_trees_generation())
        return owned(self, outputs)

    monkeypatch.setattr(CudaGraphBudget, "owned", observed)
    x = torch.ones(2, 4)
    try:
        for cuda_graphs in (True, False):
            out, doubled = kiln.compile(_HandsBackItsInput(), mode="fast", cuda_graphs=cuda_graphs)(x)
            assert torch.equal(out, x) and torch.equal(doubled, x * 2)
            if cuda_graphs:
                assert out.data_ptr() != x.data_ptr()  # the caller's own copy
    finally:
        torch._dynamo.reset()
    assert len(copied_in) == 1 and copied_in[0] <= cuda_graph_trees.KILN_STEPS_FROM  # once, inside the call's step
