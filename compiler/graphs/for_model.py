"""A KilnModel's whole-call graphs: `graphs_for_model`, the one place compiler/model.py asks.

With `cuda_graphs` auto (CompileOptions.whole_call_graphs) on a CUDA device, the model gets:

- a `WholeCallGraphs` recording with torch.cuda.CUDAGraph (compiler/graphs/recorder.py), at most
  `shapes.max_cuda_graphs` places, counting the model's compiles (a capture that compiles aborts),
  settled when a call changes nothing the stats record (`settle_marker`: compiles, the regions'
  choices and failures, calls TorchDynamo ran eagerly, shape variants), waiting while regions are
  lowered in the background;
- one `FidelityGuard`, shared by its recordings and, by blocks, its regions
  (RegionalCompile.use_fidelity_guard);
- its report in `stats.cuda_graphs` (recordings, re-captures, capture times, memory, fallbacks, and
  the guard's line), and the allocator's note (compiler/graphs/allocator.py), said once.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, Optional

import torch

from ..options.compile_options import CompileOptions
from ..stats import KilnStats
from .allocator import allocator_backend, allocator_note
from .fidelity_guard import FidelityGuard
from .recorder import CudaGraphRecorder, Recorder
from .whole_call import WholeCallGraphs

log = logging.getLogger("kiln")


def settle_marker(stats: KilnStats) -> Callable[[], Hashable]:
    """What a call changes while the model is still settling: a call that leaves it unchanged lets the next record."""
    return lambda: (stats.compile_count, len(stats.regions_eager), len(stats.region_fallbacks),
                    len(stats.region_timings), stats.eager_calls, len(stats.variants), stats.fallback)


def graphs_for_model(module: torch.nn.Module, options: CompileOptions, stats: KilnStats, label: str, device: str,
                     lowering_pending: Callable[[], list], recorder: Optional[Recorder] = None,
                     record_on: tuple[str, ...] = ("cuda",)) -> WholeCallGraphs:
    """The model's WholeCallGraphs (see the module docstring); `recorder` and `record_on` are the tests' (a
    FakeRecorder on a CPU), by default torch.cuda.CUDAGraph on CUDA."""
    def warn(note: str) -> bool:
        return stats.warn_once(note)

    graphs = WholeCallGraphs(module, recorder or CudaGraphRecorder(device), options.shapes.max_cuda_graphs,
                             lambda: stats.compile_count, marker=settle_marker(stats),
                             lowering_pending=lowering_pending, guard=FidelityGuard(), warn=warn, label=label,
                             record_on=record_on)
    stats.cuda_graphs = graphs
    note = allocator_note(allocator_backend())
    if note and stats.warn_once(note):
        log.info("Kiln: %s: %s", label, note)
    return graphs


__all__ = ["graphs_for_model", "settle_marker"]
