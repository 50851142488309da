"""The GPU suite's quantization rows, one variant per process: its weight memory and its peak memory measured
with only the model it runs loaded.

    python -m kiln.benchmarks.quant_rows --case flux-1024 --variant "kiln default + fp8_e4m3" --out DIR
    python -m kiln.benchmarks.quant_rows --tiny --case sd3-tiny --variant "kiln default + quantize defaults" --out DIR

In gpu_suite.py every variant runs in one process beside the eager model, so a quantized row's peak memory
holds the original weights too (SD1.5 quantized peaked at 3.1-4.1 GB against 1.7 GB). Here the case's model
is built, its eager output kept (the reference), the variant's quantized copy made, then the original
dropped and the peak counter reset before the variant compiles and runs: `peak_mem_gb` is the quantized
model's own. The row also has the same scheme's error run eagerly (`eager_quant_rel_err`: its compiled
error should be at most twice that), what the quantization kept and why, and the variant's speed is
compared with `kiln default` by `compare` (the rows of one case, read back from DIR). Each row goes to
DIR/<case>--<variant>.json as soon as it is measured. Variants: QUANT_VARIANTS (gpu_suite.VARIANTS' names).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..choices import DEFAULT_SCHEME
from .gpu_suite import (FULL_CASES, TINY_CASES, VARIANTS, Result, _quantized, build_case, error_line,
                        matmul_ceiling_tflops, model_flops, score, weight_gb)
from .kernel_timing import median_ms
from .side_by_side import sync, warm_up_compiler

BASELINE = "kiln default"
# variant -> (scheme, Quantize Model's defaults exactly): gpu_suite.VARIANTS' quantized rows under Kiln's default
QUANT_SCHEMES = {"kiln default + quantize defaults": (DEFAULT_SCHEME, True), "kiln default + fp8_e4m3": ("fp8_e4m3", False),
                 "kiln default + int8_dynamic": ("int8_dynamic", False)}
QUANT_VARIANTS = (BASELINE, *QUANT_SCHEMES)
assert set(QUANT_VARIANTS) <= set(VARIANTS), "the rows are the suite's variants, by name"
# the targets per case: speed against `kiln default` and weight fraction (None: no weight target)
TARGETS = {"flux-1024": (1.3, 0.55), "sdxl-1024-cfg": (1.1, 0.60), "sd15-512-cfg": (0.98, None)}
TARGET_SCHEMES = ("kiln default + fp8_e4m3", "kiln default + int8_dynamic")


def row_path(out: Path, case: str, variant: str) -> Path:
    return out / f"{case}--{re.sub(r'[^a-z0-9]+', '-', variant.lower()).strip('-')}.json"


def run_row(case, variant: str, device: str, size: str, reps: int, log=print) -> dict:
    """One variant's row, measured with only its own model loaded (see the module docstring)."""
    from .. import compiler

    module, args, kwargs = build_case(case, device, size)
    row = Result(case.name, variant)
    extra: dict = {}
    with torch.inference_mode():
        flops = model_flops(lambda: module(*args, **kwargs))
        reference = module(*args, **kwargs)[0].float().clone()
    try:
        if variant != BASELINE:  # quantize, keep the eager quantized error, then drop the original
            scheme, defaults = QUANT_SCHEMES[variant]
            quantized = _quantized(module, scheme, defaults=defaults)
            report = quantized.kiln_quant_report
            extra.update(quantized_layers=len(report.quantized), kept={r: len(n) for r, n in report.kept.items()},
                         report=report.summary())
            with torch.inference_mode():
                eager_out = quantized(*args, **kwargs)[0].float()
            extra["eager_quant_rel_err"] = ((eager_out - reference).abs().max() / reference.abs().max()).item()
            del eager_out
            module = quantized
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        runner = compiler.compile(module)  # Kiln's default: the quantized part was made above
        row.weight_gb = weight_gb(runner)
        with torch.inference_mode():
            sync(device)
            t0 = time.perf_counter()
            runner(*args, **kwargs)
            sync(device)
            row.compile_s = time.perf_counter() - t0
            row.ms = median_ms(lambda: runner(*args, **kwargs), device, warmup=3, reps=reps)
            out = runner(*args, **kwargs)[0].float().clone()
        score(row, out, reference, flops, matmul_ceiling_tflops(device, size == "tiny"))
        if device == "cuda":
            row.peak_mem_gb = torch.cuda.max_memory_allocated() / 2 ** 30
        log(f"{case.name:<18} {variant:<34} {row.ms:9.2f} ms  err {row.rel_err:.1e}  weights {row.weight_gb:.2f} GB  "
            f"peak {row.peak_mem_gb if row.peak_mem_gb is not None else float('nan'):.2f} GB  compile {row.compile_s:.1f}s")
    except Exception as exc:  # noqa: BLE001  the row keeps the error; the next variant runs in its own process
        row.error = error_line(exc)
        log(f"{case.name:<18} {variant:<34} FAILED {row.error}")
    return {"row": asdict(row), **extra}


def compare(out: Path, case: str) -> list[dict]:
    """Each quantized row of `case` in `out` against its `kiln default` row: speed and weight fraction, and
    whether the case's target is met (TARGETS)."""
    rows = {}
    for variant in QUANT_VARIANTS:
        path = row_path(out, case, variant)
        if path.exists():
            rows[variant] = json.loads(path.read_text())["row"]
    base = rows.get(BASELINE)
    if base is None or base.get("error") or not base.get("ms"):
        return []
    speed_target, weight_target = TARGETS.get(case, (None, None))
    lines = []
    for variant, row in rows.items():
        if variant == BASELINE or row.get("error") or not row.get("ms"):
            continue
        speedup, weights = base["ms"] / row["ms"], row["weight_gb"] / base["weight_gb"]
        met = None
        if speed_target is not None and (variant in TARGET_SCHEMES or case == "sd15-512-cfg"):
            met = speedup >= speed_target and (weight_target is None or weights <= weight_target)
        lines.append({"case": case, "variant": variant, "speedup_vs_kiln_default": speedup, "weight_fraction": weights,
                      "target": [speed_target, weight_target], "met": met})
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="a suite case (gpu_suite.FULL_CASES; with --tiny, TINY_CASES)")
    parser.add_argument("--variant", help=f"one of {', '.join(QUANT_VARIANTS)}")
    parser.add_argument("--compare", action="store_true", help="only compare the case's rows already in --out")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (checks the script)")
    args = parser.parse_args(argv)
    cases = {c.name: c for c in (TINY_CASES if args.tiny else FULL_CASES)}
    if args.case not in cases:
        parser.error(f"unknown case {args.case!r}; known: {', '.join(cases)}")
    if args.compare:
        print(json.dumps(compare(args.out, args.case), indent=2))
        return 0
    if args.variant not in QUANT_VARIANTS:
        parser.error(f"unknown variant {args.variant!r}; known: {', '.join(QUANT_VARIANTS)}")
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a CUDA machine, or pass --tiny for the CPU check")
    args.out.mkdir(parents=True, exist_ok=True)
    warm_up_s = warm_up_compiler(device)
    data = run_row(cases[args.case], args.variant, device, "tiny" if args.tiny else "full",
                   args.reps or (3 if args.tiny else 20))
    data.update(date=datetime.date.today().isoformat(), warm_up_s=warm_up_s,
                machine={"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__},
                method="one variant per process: eager reference, quantize, drop the original, reset the peak "
                       "counter, Kiln's default compile, median of CUDA-event timings after 3 warm-up calls")
    row_path(args.out, args.case, args.variant).write_text(json.dumps(data, indent=2))
    return 1 if data["row"]["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
