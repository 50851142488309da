"""Where a quantized model's step goes: a torch.profiler kernel table of the quantized GEMMs in place.

    python -m kiln.benchmarks.quant_profile --case sdxl-1024-cfg --scheme fp8_e4m3 --out DIR
    python -m kiln.benchmarks.quant_profile --tiny --case sd3-tiny --scheme int8_dynamic --out DIR   # CPU check

The case's model (gpu_suite's cases) is quantized under `--scheme` with `--policy` (default: Quantize
Model's, the GPU's speed rule in it; "gpu_rule: none" quantizes every layer the size threshold allows),
the original dropped, compiled with Kiln's default, warmed up, and `--steps` steps profiled. The results
(DIR/profile-<case>-<scheme>.json, and the profiler's own table in .txt beside it): every kernel (CPU op
with --tiny) with its calls and time per step, sorted by time, each put in a CATEGORIES group by its name
(the activation quantization and scale reductions, the GEMMs, the epilogues and other pointwise kernels,
attention, convolutions, norms), each group's share of the step, and the host synchronisations seen
(HOST_SYNCS: a `.item()` or a device-to-host copy in the step). Names are matched as written in
CATEGORIES, first match wins: a guide to where the time goes, not a proof; the table has every name.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

from ..choices import DEFAULT_SCHEME, SCHEMES
from .gpu_suite import FULL_CASES, TINY_CASES, build_case
from .side_by_side import sync

# group -> name fragments (lower case) of the kernels (or, on a CPU, aten ops) in it; first match wins
CATEGORIES = (
    ("gemm", ("gemm", "cutlass", "xmma", "scaled_mm", "_int_mm", "int8_mm", "weight_only_linear", "triton_tem",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "nvjet", "sm90_", "sm89_", "sm80_")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("activation quant / scale reduction", ("amax", "triton_red", "triton_per", "quantize", "aten::abs", "aten::clamp")),
    ("convolution", ("conv", "implicit_", "winograd", "cudnn")),
    ("norm", ("norm",)),
    ("epilogue / pointwise", ("triton_poi", "elementwise", "aten::mul", "aten::add", "aten::div", "aten::to", "copy")),
)
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "aten::item",
              "Memcpy DtoH")


def category(name: str) -> str:
    lowered = name.lower()
    return next((group for group, parts in CATEGORIES if any(p in lowered for p in parts)), "other")


def kernel_rows(events, steps: int, on_device: bool) -> list[dict]:
    """One row per kernel (on_device) or CPU op, sorted by its time per step."""
    rows = []
    for evt in events:
        us = evt.self_device_time_total if on_device else evt.self_cpu_time_total
        if us <= 0 or (on_device and evt.device_type != torch.autograd.DeviceType.CUDA):
            continue
        rows.append({"name": evt.key, "category": category(evt.key), "calls_per_step": evt.count / steps,
                     "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def summarize(rows: list[dict]) -> dict:
    total = sum(r["us_per_step"] for r in rows) or 1.0
    groups: dict[str, float] = {}
    for r in rows:
        groups[r["category"]] = groups.get(r["category"], 0.0) + r["us_per_step"]
    return {group: {"us_per_step": us, "share": us / total} for group, us in sorted(groups.items(), key=lambda g: -g[1])}


def host_syncs(events, steps: int, own: dict) -> dict:
    """Host synchronisations per step, less the profile's own (`own`: name -> count, the one sync after the steps)."""
    counts = {evt.key: evt.count - own.get(evt.key, 0) for evt in events if any(s in evt.key for s in HOST_SYNCS)}
    return {key: count / steps for key, count in counts.items() if count > 0}


def profile(case, scheme: str, policy, device: str, size: str, steps: int) -> tuple[dict, str]:
    from .. import compiler

    module, args, kwargs = build_case(case, device, size)
    quantized = compiler.quantize(module, scheme, policy=policy)
    report = quantized.kiln_quant_report
    del module
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    runner = compiler.compile(quantized)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        for _ in range(3):  # compile, then warm
            runner(*args, **kwargs)
        sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                runner(*args, **kwargs)
            sync(device)
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    rows = kernel_rows(events, steps, on_device=device == "cuda")
    data = {"case": case.name, "scheme": scheme, "policy": report.policy, "steps": steps, "wall_ms_per_step": wall_ms,
            "quantized_layers": len(report.quantized), "kept": {r: len(n) for r, n in report.kept.items()},
            "groups": summarize(rows), "host_syncs_per_step": host_syncs(events, steps, {"cudaDeviceSynchronize": 1} if device == "cuda" else {}), "kernels": rows,
            "kiln_stats": compiler.stats(runner).summary()}
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return data, events.table(sort_by=sort_by, row_limit=60)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True)
    parser.add_argument("--scheme", required=True, help=f"one of {', '.join(SCHEMES)} (Quantize Model's: {DEFAULT_SCHEME})")
    parser.add_argument("--policy", default=None, help="layer policy YAML (default: Quantize Model's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, CPU ops profiled (checks the script)")
    args = parser.parse_args(argv)
    cases = {c.name: c for c in (TINY_CASES if args.tiny else FULL_CASES)}
    if args.case not in cases:
        parser.error(f"unknown case {args.case!r}; known: {', '.join(cases)}")
    if args.scheme not in SCHEMES:
        parser.error(f"unknown scheme {args.scheme!r}; known: {', '.join(SCHEMES)}")
    if not 1 <= args.steps <= 20:
        parser.error("--steps must be 1 to 20")
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a CUDA machine, or pass --tiny for the CPU check")
    args.out.mkdir(parents=True, exist_ok=True)
    data, table = profile(cases[args.case], args.scheme, args.policy, device, "tiny" if args.tiny else "full", args.steps)
    data.update(date=datetime.date.today().isoformat(), torch=torch.__version__,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    stem = args.out / f"profile-{args.case}-{args.scheme}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2))
    stem.with_suffix(".txt").write_text(table)
    for group, value in data["groups"].items():
        print(f"{group:<36} {value['us_per_step'] / 1e3:8.3f} ms/step  {value['share']:6.1%}")
    print(f"host syncs per step: {data['host_syncs_per_step'] or 'none'}; wall {data['wall_ms_per_step']:.2f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
