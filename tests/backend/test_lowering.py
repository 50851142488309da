"""compiler/backend/lowering.py: what each mode's lowering makes of a graph. Mode fast with CUDA graphs records
one CUDA graph per input shape signature (torch's `cudagraphs` backend alone records the first
shapes and fails at the first new size, seen on an H200); the recordings themselves need a GPU
(tests/gpu), the bookkeeping is checked here with torch's backend replaced by a stand-in."""
import operator

import pytest
import torch
import torch._inductor.config as inductor_config

from kiln import CompileOptions
from kiln.compiler.torch_compat import dynamo, fx_graphs
from kiln.compiler.backend import lowering
from kiln.compiler.options.modes import LOWERINGS
from kiln.compiler.backend.context import ModelContext


class _Backend:
    """Stands in for torch's `cudagraphs` backend: says which signatures it was made for."""

    def __init__(self):
        self.made_for = []

    def __call__(self, gm, example_inputs):
        self.made_for.append(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in example_inputs))
        return lambda *args: ("recorded", gm(*args))


def _graph():
    return torch.fx.symbolic_trace(lambda x, n: (x * 2).sum() + n)


def test_fast_mode_records_one_cuda_graph_per_signature(monkeypatch):
    backend = _Backend()
    monkeypatch.setattr(dynamo, "lookup_backend", lambda name: backend if name == "cudagraphs" else None)
    per_shape = lowering.CudaGraphsPerShape(_graph())
    two, four = torch.ones(2, 3), torch.ones(4, 3)
    assert per_shape(two, 1) == ("recorded", 13)
    assert per_shape(four, 1) == ("recorded", 25)   # a new batch: a recording of its own, not batch 2's buffers
    assert per_shape(two, 1) == ("recorded", 13)    # batch 2 again: its first recording
    assert per_shape(two, 5) == ("recorded", 17)    # an integer input is part of the signature
    assert backend.made_for == [((2, 3),), ((4, 3),), ((2, 3),)]  # each made with its integer written in


def test_the_real_aot_path_serves_two_batches_under_inference_mode(monkeypatch):
    """What torch's `cudagraphs` backend does before recording (AOTAutograd on the captured graph,
    here with `aot_eager` in its place, since recording needs a GPU), on a graph TorchDynamo captured
    with dynamic sizes and a weight as an input, called at two batch sizes as a ComfyUI sampler does."""
    monkeypatch.setattr(dynamo, "lookup_backend", lambda name: torch._dynamo.lookup_backend("aot_eager"))
    made = []

    def backend(gm, example_inputs):
        made.append(lowering.CudaGraphsPerShape(gm))
        return made[-1]

    linear = torch.nn.Linear(3, 5)
    compiled = torch.compile(lambda x: torch.relu(linear(x)).sum(dim=-1), backend=backend, dynamic=True)
    with torch.inference_mode():
        for batch in (2, 4, 2):
            x = torch.randn(batch, 3)
            assert torch.allclose(compiled(x), torch.relu(linear(x)).sum(dim=-1))
    assert len(made) == 1 and len(made[0].by_signature) == 2  # one per batch, batch 2 served twice
    torch._dynamo.reset()


def test_torchs_own_cudagraphs_backend_takes_a_graph_captured_with_dynamic_sizes():
    """torch's `cudagraphs` backend itself (on a CPU it traces the graph, checks it for input mutations,
    then declines to record for the CPU device): a graph TorchDynamo captured with dynamic sizes takes
    them as integer inputs, and the backend failed on those ("KeyError: 'fake_result'" for every
    region of mode fast with CUDA graphs, seen on an H100) until each recording was made with its
    signature's sizes written in."""
    made = []

    def backend(gm, example_inputs):
        made.append(lowering.CudaGraphsPerShape(gm))
        return made[-1]

    linear = torch.nn.Linear(3, 5)
    compiled = torch.compile(lambda x: torch.relu(linear(x)).reshape(x.shape[0], -1, 5).sum(dim=1),
                             backend=backend, dynamic=True)
    try:
        with torch.inference_mode():
            for batch in (2, 4, 2):
                x = torch.randn(batch * 2, 3)
                expected = torch.relu(linear(x)).reshape(batch * 2, -1, 5).sum(dim=1)
                assert torch.allclose(compiled(x), expected)
    finally:
        torch._dynamo.reset()
    per_shape = made[0]
    assert any(not isinstance(n.meta.get("example_value"), torch.Tensor)
               for n in per_shape.gm.graph.nodes if n.op == "placeholder")  # a size among the graph's inputs
    assert len(made) == 1 and len(per_shape.by_signature) == 2


def _graph_using_its_sizes() -> torch.fx.GraphModule:
    """x.reshape(n, -1) * scale + n.__mul__(2), torch.full((n,), fill_value=scale), and n, as TorchDynamo
    records them: sizes in an operator, a method called on a size, a keyword argument, the output."""
    graph = torch.fx.Graph()
    x, n, scale = graph.placeholder("x"), graph.placeholder("n"), graph.placeholder("scale")
    doubled = graph.call_method("__mul__", (n, 2))
    reshaped = graph.call_method("reshape", (x, n, -1))
    scaled = graph.call_function(operator.add, (graph.call_function(operator.mul, (reshaped, scale)), doubled))
    filled = graph.call_function(torch.full, ((n,),), {"fill_value": scale})
    graph.output((scaled, filled, n))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_graph_for_a_signature_has_its_sizes_written_in():
    gm = _graph_using_its_sizes()
    args = [torch.arange(6.0), 2, 0.5]
    sized, takes = lowering.graph_for_signature(gm, args, keyed=[0, 1, 2])
    assert takes == [0]
    assert [n.op for n in sized.graph.nodes].count("placeholder") == 1
    for got, expected in zip(sized(torch.arange(6.0)), gm(*args)):  # in an operator, a method call, a call, the output
        assert got == expected if isinstance(expected, int) else torch.equal(got, expected)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 3  # the captured graph is left as it was
    with pytest.raises(ValueError, match="not part of the shape signature"):  # a value the signature does not key
        lowering.graph_for_signature(gm, args, keyed=[0, 2])
    with pytest.raises(ValueError, match="takes 3 inputs"):
        lowering.graph_for_signature(gm, args[:2], keyed=[0, 1, 2])


def test_a_weight_is_not_part_of_the_signature_and_a_failure_is_a_failed_lowering(monkeypatch):
    weight = torch.nn.Parameter(torch.ones(3))
    gm = torch.fx.symbolic_trace(lambda x, w: x * w)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    monkeypatch.setattr(fx_graphs, "is_weight", lambda node: node is placeholders[1])
    backend = _Backend()
    monkeypatch.setattr(dynamo, "lookup_backend", lambda name: backend)
    per_shape = lowering.CudaGraphsPerShape(gm)
    per_shape(torch.ones(2, 3), weight)
    per_shape(torch.ones(2, 3), torch.nn.Parameter(torch.ones(3)))  # another block's weight: same recording
    assert len(per_shape.by_signature) == 1

    def fails(gm, example_inputs):
        raise RuntimeError("no memory for the pool")

    monkeypatch.setattr(dynamo, "lookup_backend", lambda name: fails)
    with pytest.raises(lowering.LoweringFailed, match="no memory for the pool") as failed:
        per_shape(torch.ones(4, 3), weight)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert len(per_shape.by_signature) == 1  # nothing kept of the failed one


def test_a_failed_lowering_sends_the_call_to_eager_like_a_failed_compile():
    from kiln.compiler.backend.dynamo_backend import KilnBackend
    from kiln.compiler.options.compile_options import CompileOptions
    from kiln.compiler.stats import KilnStats

    options = CompileOptions()
    backend = KilnBackend(ModelContext(options, KilnStats(options.as_dict())))
    fell_back = []

    def call():
        raise lowering.LoweringFailed("CUDA graphs for a new shape could not be made: RuntimeError: x")

    assert backend.run(call, lambda: "eager answer", lambda reason, exc: fell_back.append(reason)) == "eager answer"
    assert fell_back and "could not be made" in fell_back[0]


def test_a_signature_the_budget_refuses_runs_without_cuda_graphs(monkeypatch):
    backend = _Backend()
    monkeypatch.setattr(dynamo, "lookup_backend", lambda name: backend)
    per_shape = lowering.CudaGraphsPerShape(_graph())
    allowed = {(((2, 3), (3, 1)), 1)}  # a signature: each activation's shape and strides
    with inductor_config.patch({"triton.cudagraph_capture_sizes": allowed}):  # what Kiln's budget answers
        assert per_shape(torch.ones(2, 3), 1) == ("recorded", 13)
        assert per_shape(torch.ones(4, 3), 1) == 25     # refused: the captured graph as it is
    assert backend.made_for == [((2, 3),)]


def test_fast_mode_lowers_to_the_per_signature_recorder_only_with_cuda_graphs_on_cuda():
    from kiln.compiler.options.compile_options import CompileOptions

    gm = _graph()
    fast = LOWERINGS["fast"]
    lowered, name = lowering.lower_graph(fast, gm, [torch.ones(2, 3), 1], CompileOptions(mode="fast", cuda_graphs=True), "cuda")
    assert isinstance(lowered, lowering.CudaGraphsPerShape) and name == "fx + cudagraphs"
    lowered, name = lowering.lower_graph(fast, gm, [torch.ones(2, 3), 1], CompileOptions(mode="fast", cuda_graphs=True), "cpu")
    assert name == "fx" and lowered(torch.ones(2, 3), 1) == 13


def test_mode_fast_with_cuda_graphs_says_once_that_its_recordings_copy_the_weights(monkeypatch, caplog):
    import logging

    from kiln.compiler.backend import dynamo_backend as backend_module
    from kiln.compiler.stats import KilnStats

    monkeypatch.setattr(backend_module, "device_type_of", lambda inputs: "cuda")  # what a CUDA model's inputs say
    for mode, said in (("fast", 1), ("balanced", 0)):
        options = CompileOptions(mode=mode, cuda_graphs=True)
        stats = KilnStats(options.as_dict())
        monkeypatch.setattr(dynamo, "lookup_backend", lambda name: lambda gm, args: gm.forward)
        with caplog.at_level(logging.WARNING, logger="kiln"):
            caplog.clear()
            for _ in range(2):  # two graphs of one model (its regions share its stats)
                backend_module.KilnBackend(ModelContext(options, stats))(_graph(), [torch.ones(2, 3), 1])
        notes = [r.getMessage() for r in caplog.records if "copies the weights" in r.getMessage()]
        assert len(notes) == said and len([w for w in stats.warnings if "copies the weights" in w]) == said, mode
