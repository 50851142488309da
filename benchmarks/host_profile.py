"""Where a denoising step's time goes on the host, per variant: beside the step's wall time, the time
the host takes to issue it, the GPU's busy time, the kernel launches and CUDA synchronisations per
step, and the host functions that take the most time (cProfile).

    python -m kiln.benchmarks.host_profile --case sd15-512-cfg              # on a CUDA machine
    python -m kiln.benchmarks.host_profile --tiny                           # CPU, tiny model: checks it runs

A step is host-bound when the GPU's busy time is well under its wall time: the GPU waits for the
host to issue work, and what makes it faster is fewer launches and less Python per launch (CUDA
graphs, fewer and larger kernels, less dispatch), not faster kernels. The variants are the GPU
suite's (benchmarks/gpu_suite.py), built the same way from the same case. Results: a JSON and the
log beside it in --out.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .gpu_suite import EAGER_AGAIN, FULL_CASES, VARIANTS, Case, build_case, device_busy_ms, error_line, rows_written
from .kernel_timing import median_ms
from .side_by_side import sync

RESULTS = Path(__file__).resolve().parent / "results"
TINY_CASE = Case("sd15-tiny", "sd15", 2, torch.float32)
DEFAULT_VARIANTS = ("eager", "torch.compile", "kiln balanced", "kiln balanced without kiln kernels")
# what the CUDA runtime is asked per step, by the names torch.profiler gives the calls
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


@dataclass
class HostFunction:
    where: str            # file:line(function), as cProfile names it
    ms_per_step: float    # time in the function itself, not in what it calls
    calls_per_step: float


@dataclass
class HostProfile:
    case: str
    variant: str
    ms: Optional[float] = None            # wall time per step (CUDA events on a GPU)
    host_ms: Optional[float] = None       # time to issue one step, from an idle GPU, no synchronisation
    busy_ms: Optional[float] = None       # the GPU's kernels per step (CUDA only)
    launches: Optional[float] = None      # kernel and graph launches per step (CUDA only)
    syncs: Optional[float] = None         # synchronisations per step (CUDA only)
    top: list[HostFunction] = field(default_factory=list)
    error: Optional[str] = None


def host_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median time for the host to return from `fn`, each call started with the GPU idle: the time it
    takes to issue a step, as long as the GPU's queue does not fill."""
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    sync(device)
    return statistics.median(times)


def runtime_calls(fn: Callable[[], object], steps: int) -> tuple[float, float]:
    """(kernel launches, synchronisations) per call of `fn`, from torch.profiler's CUDA runtime events,
    less what a profile of no call counts (the profiler's own synchronisations and ours)."""
    fn()
    torch.cuda.synchronize()
    launches, syncs = _runtime_counts(fn, steps)
    idle_launches, idle_syncs = _runtime_counts(lambda: None, steps)
    return max(launches - idle_launches, 0) / steps, max(syncs - idle_syncs, 0) / steps


def _runtime_counts(fn: Callable[[], object], steps: int) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    counts = {event.key: event.count for event in prof.key_averages()}
    return sum(counts.get(name, 0) for name in LAUNCHES), sum(counts.get(name, 0) for name in SYNCS)


def top_functions(fn: Callable[[], object], steps: int, count: int) -> list[HostFunction]:
    """The `count` functions with the most time of their own over `steps` calls of `fn` (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own time, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [HostFunction(f"{_short(file)}:{line}({name})", own * 1e3 / steps, calls / steps)
            for (file, line, name), (_, calls, own, _, _) in rows]


def _short(path: str) -> str:
    """A file's path from its package on (site-packages/torch/... -> torch/...)."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = Path(path).parts
    return "/".join(parts[-3:]) if len(parts) > 3 else path


def profile_case(case: Case, variants: list[str], device: str, size: str, reps: int, steps: int, count: int,
                 log, on_row=lambda row: None) -> list[HostProfile]:
    """Every variant's row, then eager's again; `on_row` gets each row as it ends (the results file is
    written then: a run cut short by a time limit keeps the rows it finished)."""
    module, args, kwargs = build_case(case, device, size)
    rows = []
    for name in variants:
        row = HostProfile(case.name, name)
        rows.append(row)
        try:
            runner = VARIANTS[name](module)
            with torch.inference_mode():
                step = lambda: runner(*args, **kwargs)  # noqa: E731
                step()  # the first call compiles
                row.ms = median_ms(step, device, warmup=3, reps=reps)
                row.host_ms = host_ms(step, device, reps)
                if device == "cuda":
                    row.busy_ms = device_busy_ms(step)
                    row.launches, row.syncs = runtime_calls(step, steps)
                row.top = top_functions(step, steps, count)
            busy = f"  GPU busy {row.busy_ms:7.2f} ms  {row.launches:6.0f} launches  {row.syncs:4.1f} syncs" \
                if row.busy_ms is not None else ""
            log(f"{case.name:<14} {name:<36} {row.ms:8.2f} ms/step  host {row.host_ms:8.2f} ms{busy}")
            for fn in row.top:
                log(f"    {fn.ms_per_step:8.3f} ms  {fn.calls_per_step:7.1f} calls  {fn.where}")
        except Exception as exc:  # noqa: BLE001  recorded; the other variants still run
            row.error = error_line(exc)
            log(f"{case.name:<14} {name:<36} FAILED {row.error}\n{traceback.format_exc()}")
        finally:
            torch._dynamo.reset()  # each variant compiles from scratch
        on_row(row)
    first = rows[0] if rows else None
    if first is not None and first.variant == "eager" and first.ms is not None and len(rows) > 1:
        rows.append(eager_again(case, module, args, kwargs, device, reps, first, log))
        on_row(rows[-1])
    return rows


def eager_again(case: Case, module, args, kwargs, device: str, reps: int, first: HostProfile, log) -> HostProfile:
    """Eager's wall and host time once more after every other variant (see gpu_suite.eager_again: the
    host's speed drifts, and CUPTI stays attached after the first CUDA profile)."""
    row = HostProfile(case.name, EAGER_AGAIN)
    with torch.inference_mode():
        step = lambda: module(*args, **kwargs)  # noqa: E731
        row.ms = median_ms(step, device, warmup=3, reps=reps)
        row.host_ms = host_ms(step, device, reps)
    log(f"{case.name:<14} {EAGER_AGAIN:<36} {row.ms:8.2f} ms/step  host {row.host_ms:8.2f} ms  (the first eager "
        f"row {first.ms:.2f} / {first.host_ms:.2f} ms)")
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny SD1.5 on the CPU (checks the tool, measures nothing real)")
    parser.add_argument("--case", default="sd15-512-cfg", help=f"one of {[c.name for c in FULL_CASES]}")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated GPU suite variants")
    parser.add_argument("--reps", type=int, default=20, help="steps timed per variant")
    parser.add_argument("--steps", type=int, default=5, help="steps profiled per variant")
    parser.add_argument("--top", type=int, default=15, help="host functions listed per variant")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a CUDA machine, or pass --tiny for the CPU check")
    cases = {c.name: c for c in FULL_CASES}
    if not args.tiny and args.case not in cases:
        parser.error(f"unknown case {args.case!r}; known: {sorted(cases)}")
    case = TINY_CASE if args.tiny else cases[args.case]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"host-{datetime.date.today().isoformat()}-{case.name}"
    rows: list[HostProfile] = []
    data = {"date": datetime.date.today().isoformat(), "machine": {"device": device_name, "torch": torch.__version__},
            "case": case.name, "method": "ms: median of CUDA-event timings per step after 3 warm-up steps; host_ms: "
            "median time to return from a step started on an idle GPU; busy, launches, syncs: torch.profiler over "
            f"{args.steps} steps; top: cProfile over {args.steps} steps, own time per step",
            "results": []}

    write = rows_written(stem.with_suffix(".json"), data, rows)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2))  # there from the start, rows or not
    with open(stem.with_suffix(".log"), "w") as log_file:
        def log(msg: str) -> None:
            print(msg, flush=True)
            log_file.write(msg + "\n")
            log_file.flush()

        log(f"kiln host profile on {device_name}, torch {torch.__version__}: {case.name}")
        profile_case(case, variants, device, "tiny" if args.tiny else "full", args.reps, args.steps, args.top, log,
                     on_row=write)
    print(f"wrote {stem.with_suffix('.json')}")
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
