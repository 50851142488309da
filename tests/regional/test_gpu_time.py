"""The region choice reads its samples from a clock (compiler/regional/gpu_time.py): the GPU's own time on
CUDA, the host's wall clock elsewhere. Timings here are injected: a clock answering per side."""
import pytest
import torch

from kiln.compiler.regional import gpu_time, region_choice
from kiln.compiler.regional.gpu_time import GPU_TIME, WALL_CLOCK, SampleTime, WallClock, clock_for
from kiln.compiler.regional.region_choice import time_both


class SideClock:
    """A clock that answers, for a sample of the compiled or the eager side, the (ms, host_ms) given
    per call of that side; which side ran it tells from the calls the sample made."""

    basis = GPU_TIME

    def __init__(self, compiled: tuple[float, float], eager: tuple[float, float]):
        self.per_call = {"c": compiled, "e": eager}
        self.ran: list[str] = []

    def sample(self, run):
        self.ran.clear()
        run()
        side = set(self.ran)
        assert len(side) == 1 and self.ran  # a sample runs one side's calls only
        ms, host_ms = self.per_call[side.pop()]
        return SampleTime(ms * len(self.ran), host_ms * len(self.ran))


def _timed(clock, device="cuda"):
    def compiled(args, kwargs):
        clock.ran.append("c")

    def eager(args, kwargs):
        clock.ran.append("e")

    return time_both(compiled, eager, (torch.zeros(3),), {}, device, rounds=4, clock=clock)


@pytest.fixture
def gpu_memory(monkeypatch):
    monkeypatch.setattr(region_choice, "_free_gpu_bytes", lambda: 1 << 40)


def test_compiled_faster_on_the_gpu_though_slower_by_the_host_wall_clock_stays_compiled(gpu_memory):
    timing = _timed(SideClock(compiled=(1.0, 3.0), eager=(2.0, 2.0)))
    assert (timing.compiled_ms, timing.eager_ms) == (1.0, 2.0)
    assert (timing.compiled_host_ms, timing.eager_host_ms) == (3.0, 2.0)
    assert timing.compiled_pays and timing.reason() == ""
    assert timing.line() == ("compiled 1.000 ms, eager 2.000 ms a call by GPU time (2.00x); "
                             "host wall clock compiled 3.000 ms, eager 2.000 ms (0.67x)")


def test_compiled_slower_on_the_gpu_though_faster_by_the_host_wall_clock_runs_eagerly(gpu_memory):
    timing = _timed(SideClock(compiled=(2.0, 1.0), eager=(1.5, 3.0)))
    assert not timing.compiled_pays
    assert timing.reason() == ("measured no faster compiled (compiled 2.000 ms, eager 1.500 ms a call by GPU time "
                               "(0.75x); host wall clock compiled 1.000 ms, eager 3.000 ms (3.00x); compiled must "
                               f"be {region_choice.MIN_GAIN:.0%} faster)")


def test_each_side_is_warmed_up_once_before_its_samples(gpu_memory):
    order = []
    clock = SideClock((1.0, 1.0), (1.0, 1.0))
    time_both(lambda a, k: (order.append("c"), clock.ran.append("c")),
              lambda a, k: (order.append("e"), clock.ran.append("e")), (torch.zeros(3),), {}, "cuda", rounds=2,
              clock=clock)
    n = region_choice.PIPELINED_CALLS
    assert order == ["c", "e"] + ["c"] * n + ["e"] * n + ["e"] * n + ["c"] * n


def test_the_clock_is_the_gpus_own_on_cuda_and_the_wall_clock_elsewhere():
    assert clock_for("cuda").basis == GPU_TIME and isinstance(clock_for("cuda"), gpu_time.GpuClock)
    assert clock_for("cpu").basis == WALL_CLOCK and clock_for("mps").basis == WALL_CLOCK


def test_the_wall_clock_reads_the_host_between_two_synchronisations(monkeypatch):
    syncs = []
    monkeypatch.setattr(gpu_time, "_sync", lambda device: syncs.append(device))
    readings = iter([1.0, 1.25])
    monkeypatch.setattr(gpu_time.time, "perf_counter", lambda: next(readings))
    ran = []
    sample = WallClock("cuda").sample(lambda: ran.append(1))
    assert ran == [1] and syncs == ["cuda", "cuda"]
    assert sample == SampleTime(250.0, 250.0)


def test_a_timing_read_back_from_the_cache_names_no_clock():
    stored = region_choice.RegionTiming.from_bytes(region_choice.RegionTiming(1.0, 2.0, GPU_TIME, 3.0, 1.0).to_bytes(),
                                                   "test")
    assert stored == region_choice.RegionTiming(1.0, 2.0)
    assert stored.line() == "compiled 1.000 ms, eager 2.000 ms a call (2.00x)"
