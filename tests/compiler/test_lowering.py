"""compiler/lowering.py: what each mode's lowering makes of a graph. Mode fast with CUDA graphs records
one CUDA graph per input shape signature (torch's `cudagraphs` backend alone records the first
shapes and fails at the first new size, seen on an H200); the recordings themselves need a GPU
(tests/gpu), the bookkeeping is checked here with torch's backend replaced by a stand-in."""
import torch
import torch._inductor.config as inductor_config

from kiln.compiler import compat, lowering


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
    monkeypatch.setattr(compat, "lookup_backend", lambda name: backend if name == "cudagraphs" else None)
    per_shape = lowering.CudaGraphsPerShape(_graph())
    two, four = torch.ones(2, 3), torch.ones(4, 3)
    assert per_shape(two, 1) == ("recorded", 13)
    assert per_shape(four, 1) == ("recorded", 25)   # a new batch: a recording of its own, not batch 2's buffers
    assert per_shape(two, 1) == ("recorded", 13)    # batch 2 again: its first recording
    assert per_shape(two, 5) == ("recorded", 17)    # an integer input is part of the signature
    assert backend.made_for == [((2, 3), 1), ((4, 3), 1), ((2, 3), 5)]


def test_a_signature_the_budget_refuses_runs_without_cuda_graphs(monkeypatch):
    backend = _Backend()
    monkeypatch.setattr(compat, "lookup_backend", lambda name: backend)
    per_shape = lowering.CudaGraphsPerShape(_graph())
    allowed = {((2, 3), 1)}
    monkeypatch.setattr(inductor_config.triton, "cudagraph_capture_sizes", allowed)  # what Kiln's budget answers
    assert per_shape(torch.ones(2, 3), 1) == ("recorded", 13)
    assert per_shape(torch.ones(4, 3), 1) == 25     # refused: the captured graph as it is
    assert backend.made_for == [((2, 3), 1)]


def test_fast_mode_lowers_to_the_per_signature_recorder_only_with_cuda_graphs_on_cuda():
    from kiln.compiler.options import CompileOptions

    gm = _graph()
    fast = lowering.LOWERINGS["fast"]
    lowered, name = fast.lower(gm, [torch.ones(2, 3), 1], CompileOptions(mode="fast", cuda_graphs=True), "cuda")
    assert isinstance(lowered, lowering.CudaGraphsPerShape) and name == "fx + cudagraphs"
    lowered, name = fast.lower(gm, [torch.ones(2, 3), 1], CompileOptions(mode="fast", cuda_graphs=True), "cpu")
    assert name == "fx" and lowered(torch.ones(2, 3), 1) == 13
