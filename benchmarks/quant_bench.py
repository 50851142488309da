"""`kiln bench --quant`: every quantization scheme beside the unquantized model, side by side in one run.

For each scheme: weight memory, time per step quantized and eager, quantized and compiled by
Kiln, and the output error against eager; beside eager and Kiln's compile of the unquantized
model. All variants are timed in the same interleaved rounds (side_by_side.time_interleaved).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable

import torch

from .side_by_side import DTYPES, own_code, own_inputs, sync, time_interleaved, warm_up_compiler
from ..testing.models import MODELS


def _mib(module: torch.nn.Module) -> float:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers())) / 2**20


def run_quant_bench(model: str = "sd15", size: str = "cpu", device: str = "cpu", dtype: str = "fp32", batch: int = 2,
                    schemes=("int8_weight", "int8_dynamic", "fp8_e4m3"), mode: str = "balanced", policy: str = "",
                    rounds: int = 4, steps: int = 2, log=print) -> dict:
    from .. import compiler as kiln

    spec = MODELS[model]
    module = spec.build(size, dtype=DTYPES[dtype], device=device)
    args, kwargs = spec.inputs(module, batch, device=device, dtype=DTYPES[dtype])
    log(f"kiln bench --quant: {spec.description}, {size} size, {device} {dtype}, batch {batch}, Kiln mode {mode}")
    log(f"  warm-up compile (what a process's first compile pays once, paid here for every variant): "
        f"{warm_up_compiler(device):.1f}s")
    variants: dict[str, tuple[Callable, float, str]] = {  # name -> (callable, weight MiB, scheme)
        "eager": (module, _mib(module), "none"),
        f"kiln {mode}": (kiln.compile(own_code(module, "kiln_plain"), mode=mode), _mib(module), "none"),
    }
    reports = {}
    for scheme in schemes:
        quantized = kiln.quantize(module, scheme, policy=policy)
        reports[scheme] = quantized.kiln_quant_report
        variants[f"{scheme} eager"] = (quantized, _mib(quantized), scheme)
        variants[f"{scheme} + kiln {mode}"] = (kiln.compile(own_code(quantized, f"kiln_{scheme}"), mode=mode),
                                               _mib(quantized), scheme)
    rows, calls = {}, {}
    with torch.inference_mode():
        reference = None
        inputs = {}
        for name, (fn, mib, scheme) in variants.items():
            row = rows[name] = {"variant": name, "scheme": scheme, "weight_mib": round(mib, 2), "error": None}
            own_args, own_kwargs = inputs[name] = own_inputs(args, kwargs)
            try:
                sync(device)
                start = time.perf_counter()
                out = fn(*own_args, **own_kwargs)[0].float()
                sync(device)
                row["first_call_s"] = time.perf_counter() - start
                reference = out if reference is None else reference
                row["rel_l2_err"] = ((out - reference).norm() / reference.norm()).item()
                calls[name] = fn
                log(f"  {name}: first call {row['first_call_s']:.1f}s")
            except Exception as exc:  # noqa: BLE001  a failing variant is recorded, the rest still run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                log(f"  {name}: FAILED {row['error']}")
        times = time_interleaved(calls, inputs, device, rounds, steps)
    eager_ms = statistics.median(times["eager"])
    for name, samples in times.items():
        rows[name]["step_ms"] = statistics.median(samples)
        rows[name]["speedup_vs_eager"] = eager_ms / rows[name]["step_ms"]
    plain = rows[f"kiln {mode}"].get("step_ms")
    for row in rows.values():
        if plain and row.get("step_ms"):
            row["speedup_vs_kiln_unquantized"] = plain / row["step_ms"]
        row["weight_vs_eager"] = row["weight_mib"] / rows["eager"]["weight_mib"]
    return {"model": model, "size": size, "device": device, "dtype": dtype, "batch": batch, "mode": mode,
            "policy": policy, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "method": f"median of {rounds} interleaved rounds x {steps} steps; error: relative L2 against eager",
            "rows": list(rows.values()),
            "reports": {s: {"quantized": len(r.quantized), "kept": r.kept_count} for s, r in reports.items()}}


def format_table(result: dict) -> str:
    head = f"{'variant':<30}{'weights MiB':>12}{'vs eager':>9}{'ms/step':>10}{'vs eager':>9}{'vs kiln':>9}{'rel L2 err':>12}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"{r['variant']:<30}  FAILED: {r['error']}")
            continue
        lines.append(f"{r['variant']:<30}{r['weight_mib']:>12.1f}{r['weight_vs_eager']:>8.0%} {r['step_ms']:>10.2f}"
                     f"{r['speedup_vs_eager']:>8.2f}x{r.get('speedup_vs_kiln_unquantized', 0):>8.2f}x{r['rel_l2_err']:>12.2e}")
    lines.append("layers quantized/kept: " + ", ".join(f"{s} {v['quantized']}/{v['kept']}" for s, v in result["reports"].items()))
    return "\n".join(lines)


def main(args) -> int:
    size = args.size or ("full" if args.device == "cuda" else "cpu")
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    mode = (args.modes or "balanced").split(",")[0]
    result = run_quant_bench(args.model, size, args.device, dtype, args.batch, [s for s in args.schemes.split(",") if s],
                             mode, args.policy, args.rounds, args.steps,
                             log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if any(r["error"] for r in result["rows"]) else 0
