"""Timing helpers shared by the kernel benchmarks: median time per call, CUDA events on a GPU."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], device: str, warmup: int = 5, reps: int = 50) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare(name: str, cases: list[tuple[str, tuple]], ref: Callable, kiln_op: Callable, device: str, reps: int) -> list[dict]:
    """Time eager reference, torch.compile(reference) and the Kiln op on each case."""
    import torch

    compiled_ref = torch.compile(ref)
    rows = []
    for label, args in cases:
        row = {"kernel": name, "shape": label}
        for variant, fn in (("eager", ref), ("inductor", compiled_ref), ("kiln", kiln_op)):
            try:
                row[f"{variant}_ms"] = median_ms(lambda: fn(*args), device, reps=reps)
            except Exception as exc:  # noqa: BLE001  recorded, the others still run
                row[f"{variant}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'kernel':<22}{'shape':<34}{'eager ms':>10}{'inductor ms':>13}{'kiln ms':>10}{'kiln vs inductor':>18}")
    for r in rows:
        e, i, k = (r.get(f"{v}_ms") for v in ("eager", "inductor", "kiln"))
        ratio = f"{i / k:.2f}x" if i and k else "-"
        fmt = lambda v: f"{v:.3f}" if v is not None else "FAILED"  # noqa: E731
        print(f"{r['kernel']:<22}{r['shape']:<34}{fmt(e):>10}{fmt(i):>13}{fmt(k):>10}{ratio:>18}")
