"""Whole model calls recorded and replayed as CUDA graphs, and the fidelity guard.

One piece per file: `recording_key.py` (what a recording assumes), `static_inputs.py` (where a
replay reads its inputs), `recorder.py` (the Recorder protocol and its torch.cuda.CUDAGraph
implementation), `fake_recorder.py` (a CUDA graph's semantics on any device, for tests),
`graph_safety.py` (which calls may be replayed, and the typed reasons for those that may not),
`allocator.py` (what the CUDA allocator backend means for recordings), `fidelity_guard.py` (compiled
regions and recordings checked once against the code they replace) and `whole_call.py` (the steps
of one call). The host's conventions (its patches, its options dict) come through
compiler/host_inputs.py; docs/cuda-graphs.md has the rules.
"""
from .fidelity_guard import FidelityGuard, compare, tolerance_for
from .graph_safety import GraphFallback, GraphVerdict
from .recording_key import RecordingKey, recording_key
from .whole_call import GraphsReport, WholeCallGraphs

__all__ = ["FidelityGuard", "compare", "tolerance_for", "GraphFallback", "GraphVerdict", "RecordingKey",
           "recording_key", "GraphsReport", "WholeCallGraphs"]
