"""`kiln bench --cache`: how long a restarted process waits for its first denoising step.

Every run is a fresh process (`python -m kiln.benchmarks.cache_bench --child ...`), in order:

  kiln cold       Kiln's compile with an empty Kiln cache (it stores an entry)
  kiln warm       the same, next process: Kiln's cache has the entry
  torch.compile cold / warm   torch.compile (Inductor) twice on one Inductor cache directory:
                  the warm run is torch.compile's own warm start

Each child builds the model first (not timed), then times compile + first step, and reports
TorchDynamo's capture, the lowering, Inductor's cache counters and a checksum of the output. Each
warm start is a restart that keeps Inductor's own folders, as a server's restart does: the two Kiln
runs share one TORCHINDUCTOR_CACHE_DIR and temporary folder (TMPDIR: Inductor keeps its precompiled
C++ headers there whatever TORCHINDUCTOR_CACHE_DIR says), the two torch.compile runs another. Kiln
lowers into folders of its own, so its warm run gets its graphs only from Kiln's cache; what it finds
in Inductor's own folders is the CPU probe's programs and the C++ header, as torch.compile's does.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

GPU_WARM_TARGET_S = 10  # on a CUDA machine at SDXL size: a restarted process's first step
RUNS = ("kiln cold", "kiln warm", "torch.compile cold", "torch.compile warm")
SAME_OUTPUT = 1e-5  # relative difference of the output checksums, cold vs warm


def _relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def child(args) -> dict:
    """One run, in this (fresh) process."""
    import torch

    from .. import compiler as kiln
    from ..compiler.torch_compat import inductor
    from .side_by_side import DTYPES, sync
    from ..testing.models import MODELS

    spec = MODELS[args.model]
    torch.manual_seed(0)
    module = spec.build(args.size, dtype=DTYPES[args.dtype], device=args.device)
    inputs, kwargs = spec.inputs(module, args.batch, device=args.device, dtype=DTYPES[args.dtype])
    if args.run.startswith("kiln"):
        fn = kiln.compile(module, mode=args.mode, cache_dir=args.cache_dir)
    else:
        fn = torch.compile(module)
    before = inductor.inductor_cache_counts()
    with torch.inference_mode():
        sync(args.device)
        start = time.perf_counter()
        out = fn(*inputs, **kwargs)[0]
        sync(args.device)
        first = time.perf_counter() - start
    counts = {k: v - before[k] for k, v in inductor.inductor_cache_counts().items() if v - before[k]}
    result = {"run": args.run, "first_step_s": first, "inductor": counts, "checksum": float(out.double().abs().sum())}
    if args.run.startswith("kiln"):
        stats = kiln.stats(fn)
        result["capture_s"] = sum(c.capture_seconds for c in stats.compiles)
        result["lowering_s"] = sum(c.seconds for c in stats.compiles)
        result["cache"] = [event.line() for event in stats.cache]
        result["fallback"] = stats.fallback
        result["blocks"] = stats.units_line()
    return result


def _run_child(args, run: str, cache_dir: str, inductor_dir: str, temp_dir: str, log) -> dict:
    command = [sys.executable, "-m", "kiln.benchmarks.cache_bench", "--child", run, "--model", args.model,
               "--size", args.size, "--device", args.device, "--dtype", args.dtype, "--batch", str(args.batch),
               "--mode", args.cache_mode, "--cache-dir", cache_dir]
    os.makedirs(temp_dir, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, TMPDIR=temp_dir)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        result = {"run": run, "error": " | ".join(tail)[:500]}
    else:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    log(f"  {run}: " + (f"first step {result['first_step_s']:.1f}s (process {wall:.1f}s)" if "first_step_s" in result
                        else f"FAILED {result['error']}"))
    return result


def run_cache_bench(args, log=print) -> dict:
    import torch

    from ..testing.models import MODELS

    work = tempfile.mkdtemp(prefix="kiln-cache-bench-")
    cache_dir = os.path.join(work, "kiln-cache")
    log(f"kiln bench --cache: {MODELS[args.model].description}, {args.size} size, {args.device} {args.dtype}, "
        f"batch {args.batch}, Kiln mode {args.cache_mode}; each run a fresh process")
    rows = []
    try:
        for run in RUNS:
            family = "torch-compile" if run.startswith("torch") else "kiln"
            inductor_dir, temp_dir = os.path.join(work, f"inductor-{family}"), os.path.join(work, f"temp-{family}")
            rows.append(_run_child(args, run, cache_dir, inductor_dir, temp_dir, log))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_run = {row["run"]: row for row in rows}
    ok = all("first_step_s" in row for row in rows)
    summary = {}
    if ok:
        cold, warm, torch_warm = (by_run[r]["first_step_s"] for r in ("kiln cold", "kiln warm", "torch.compile warm"))
        summary = {
            "kiln_warm_vs_cold": warm / cold,
            "kiln_warm_vs_torch_compile_warm": warm / torch_warm,
            "target_warm_at_most_10pct_of_cold": warm <= 0.10 * cold,
            "target_faster_than_torch_compile_warm": warm < torch_warm,
            # relative: the cold run's first step runs every region compiled (each is measured after its first
            # call), the warm one's runs the regions measured slower eagerly from the start
            "output_difference_cold_warm": _relative_difference(by_run["kiln cold"]["checksum"],
                                                                by_run["kiln warm"]["checksum"]),
        }
        summary["same_output_cold_warm"] = summary["output_difference_cold_warm"] <= SAME_OUTPUT
        if args.device == "cuda":
            summary[f"target_warm_under_{GPU_WARM_TARGET_S}s"] = warm < GPU_WARM_TARGET_S
    return {"model": args.model, "size": args.size, "device": args.device, "dtype": args.dtype, "batch": args.batch,
            "mode": args.cache_mode, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "method": "time to first step (compile + first call) in a fresh process per run; model build not timed",
            "rows": rows, "summary": summary}


def format_table(result: dict) -> str:
    lines = [f"{'run':<20} {'first step':>11} {'capture':>8} {'lowering':>9}  cache / Inductor"]
    for row in result["rows"]:
        if "first_step_s" not in row:
            lines.append(f"{row['run']:<20} FAILED: {row['error']}")
            continue
        extra = "; ".join(row.get("cache", [])) or ", ".join(f"{k} {v}" for k, v in row["inductor"].items())
        capture = f"{row['capture_s']:.1f}s" if "capture_s" in row else "-"
        lowering = f"{row['lowering_s']:.1f}s" if "lowering_s" in row else "-"
        lines.append(f"{row['run']:<20} {row['first_step_s']:>10.1f}s {capture:>8} {lowering:>9}  {extra}")
    lines += [f"{row['run']}: {row['blocks']}" for row in result["rows"] if row.get("blocks")]
    s = result["summary"]
    if s:
        lines.append(f"Kiln warm start: {100 * s['kiln_warm_vs_cold']:.1f}% of its cold compile (target <= 10%: "
                     f"{'met' if s['target_warm_at_most_10pct_of_cold'] else 'NOT met'}); "
                     f"{s['kiln_warm_vs_torch_compile_warm']:.2f}x torch.compile's warm start (target < 1: "
                     f"{'met' if s['target_faster_than_torch_compile_warm'] else 'NOT met'}); "
                     f"same output cold and warm: {s['same_output_cold_warm']} (checksums differ by "
                     f"{s.get('output_difference_cold_warm', 0.0):.1e}, relative)")
        key = f"target_warm_under_{GPU_WARM_TARGET_S}s"
        if key in s:
            lines.append(f"GPU target, warm start under {GPU_WARM_TARGET_S}s: {'met' if s[key] else 'NOT met'}")
    return "\n".join(lines)


def main(args) -> int:
    from .side_by_side import default_size_and_dtype, print_and_save

    default_size_and_dtype(args)
    args.cache_mode = (args.modes or "balanced").split(",")[0]
    result = run_cache_bench(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print_and_save(format_table(result), result, args.json)
    return 0 if result["summary"] else 1


if __name__ == "__main__":
    from .side_by_side import child_parser

    print(json.dumps(child(child_parser(RUNS).parse_args())))
