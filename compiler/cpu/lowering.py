"""What a lowering on a CPU needs before Inductor runs: the CPU probe in Inductor's own folder, and
Inductor's compile without Triton's worker processes."""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from ..torch_compat import inductor

log = logging.getLogger("kiln")

PARALLEL_PROBE = True  # each reported instruction set checked in a thread of its own, not one after another


def before_lowering(device: str) -> None:
    """Before a graph is lowered for `device`: on a CPU, Inductor's probe of the CPU's vector
    instruction sets, once a process, here, in Inductor's current (its own) cache folder. Inductor
    would probe at its first CPU kernel, and with Kiln's cache that kernel is built in a lowering's
    fresh private folder (compiler/cache/graph_cache.py), where the probe's test programs would be
    built again by every process; in Inductor's own folder the next process only loads them. The
    instruction sets the CPU reports are checked side by side (PARALLEL_PROBE)."""
    if device != "cpu" or inductor.cpu_vector_isa_detected():
        return
    start = time.perf_counter()
    inductor.detect_cpu_vector_isa(in_parallel=PARALLEL_PROBE)
    log.info("Kiln: Inductor probed the CPU's vector instruction sets in %.1fs (once a process)",
             time.perf_counter() - start)


def inductor_compile(device: str) -> Optional[Callable]:
    """On a CPU, Inductor's compile itself: its registered backend first starts the worker processes
    that compile Triton kernels when Triton is installed (a helper process and one worker per compile
    thread, each importing torch), which a CPU graph's C++ kernels never use and which take the cores
    from the lowering and from the timing of the region just compiled. None elsewhere: the caller
    uses the registered backend."""
    return inductor.inductor_compile_fx() if device == "cpu" else None
