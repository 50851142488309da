"""The clock a region's timing samples are read from: the host's wall clock on a CPU, the GPU's own time on CUDA.

`time_both` (compiler/regional/region_choice.py) asks its clock for one sample at a time: `sample(run)`
runs `run` (a few calls of the region) and answers `SampleTime(ms, host_ms)`: `ms` is the time the
choice is made on, `host_ms` what the host's wall clock read, for the log. Tests inject a clock of
their own (any object with `basis` and `sample`).

- **On a CPU** (`WallClock`): the wall clock, between two synchronisations, as before: the host does
  the work, so its time is the work's time.
- **On CUDA** (`GpuClock`): the GPU's own time for the calls, read by CUDA events around them. So that
  the events time the kernels and not the host issuing them, a spin kernel is queued first
  (compiler/torch_compat/cuda_timing.py) that keeps the GPU busy while the host issues the calls: it
  spins HOST_AHEAD_MARGIN times the host time the previous sample took to issue (FIRST_SPIN_MS for the
  first), so the calls' kernels wait in the queue and run back to back. A sample whose issuing outlasted
  its spin (the GPU may have waited on the host) is taken again once with a spin sized by it
  (`SampleTime.host_bound` says when even that one was). A region then stays compiled when it saves
  GPU time: the host's part of a step is what CUDA graphs take out (`cuda_graphs: true`), and the
  kernels Inductor's fusion removes are what no recording can remove.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Protocol

import torch

from ..torch_compat import cuda_timing

GPU_TIME = "GPU time"
WALL_CLOCK = "host wall clock"
HOST_AHEAD_MARGIN = 1.5  # the spin lasts this many times the host's issuing time of the previous sample ...
FIRST_SPIN_MS = 20.0     # ... and this long before the first sample
MAX_SPIN_MS = 2000.0     # never longer than this (a region's few calls issue in well under that)
CALIBRATION_CYCLES = 10_000_000  # spin cycles timed once a process to turn milliseconds into cycles


class SampleTime(NamedTuple):
    """One sample: `ms` the time the choice is made on, `host_ms` the host's wall clock over the same calls."""

    ms: float
    host_ms: float
    host_bound: bool = False  # the GPU may have waited on the host: the issuing outlasted the spin


class RegionClock(Protocol):
    basis: str  # GPU_TIME or WALL_CLOCK: what `SampleTime.ms` measures, named in the log

    def sample(self, run: Callable[[], object]) -> SampleTime: ...


class WallClock:
    """The host's wall clock between two synchronisations of `device` (CUDA synchronised on a GPU)."""

    basis = WALL_CLOCK

    def __init__(self, device: str):
        self.device = device

    def sample(self, run: Callable[[], object]) -> SampleTime:
        _sync(self.device)
        start = time.perf_counter()
        run()
        _sync(self.device)
        ms = (time.perf_counter() - start) * 1e3
        return SampleTime(ms, ms)


class GpuClock:
    """The GPU's own time for a sample's calls: CUDA events around them, with the GPU kept busy by a spin
    kernel while the host issues them (see the module docstring)."""

    basis = GPU_TIME

    def __init__(self):
        self.cycles_per_ms = 0.0
        self.last_host_ms = FIRST_SPIN_MS / HOST_AHEAD_MARGIN

    def sample(self, run: Callable[[], object]) -> SampleTime:
        first = self._timed(run, self.last_host_ms * HOST_AHEAD_MARGIN)
        if not first.host_bound:
            return first
        return self._timed(run, first.host_ms * HOST_AHEAD_MARGIN)  # once more, with a spin sized by that sample

    def _timed(self, run: Callable[[], object], spin_ms: float) -> SampleTime:
        spin_ms = min(spin_ms, MAX_SPIN_MS)
        cycles = self._cycles_per_ms() * spin_ms
        begin, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        begin.record()
        cuda_timing.gpu_spin(cycles)
        start.record()
        issued = time.perf_counter()
        run()
        end.record()
        host_ms = (time.perf_counter() - issued) * 1e3
        end.synchronize()
        self.last_host_ms = host_ms
        # the spin ended before the calls were all issued: the GPU may have waited on the host
        host_bound = begin.elapsed_time(start) < host_ms
        return SampleTime(start.elapsed_time(end), host_ms, host_bound)

    def _cycles_per_ms(self) -> float:
        if not self.cycles_per_ms:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            cuda_timing.gpu_spin(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            self.cycles_per_ms = CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)
        return self.cycles_per_ms


def clock_for(device: str) -> RegionClock:
    """The clock a region's timing uses on `device`: the GPU's own time on CUDA, the wall clock elsewhere."""
    return GpuClock() if device == "cuda" else WallClock(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
