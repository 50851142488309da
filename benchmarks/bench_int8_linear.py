"""Benchmark Kiln's quantized Linear ops against the dense Linear at SD1.5, SDXL and Flux shapes.

    python -m kiln.benchmarks.bench_int8_linear --device cuda --dtype bf16 [--json PATH]
    python -m kiln.benchmarks.bench_int8_linear --small     # CPU smoke run (the ops run their references)

Per shape, one row per op (int8_weight_linear, int8_dynamic_linear, fp8_weight_linear): its eager
reference (dequantize, matmul in fp32), that reference under Inductor, and the Kiln op; beside them
`dense_ms`, F.linear with the float weight in the activations' dtype, the time to beat.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from ..kernels import (fp8_weight_linear, fp8_weight_linear_ref, int8_dynamic_linear, int8_dynamic_linear_ref,
                       int8_weight_linear, int8_weight_linear_ref)
from .kernel_timing import compare, median_ms, print_rows

# (M = batch x tokens, K = in features, N = out features): SD1.5 at 512^2 with CFG (4096 tokens, 320 channels),
# SDXL at 1024^2 (level 3: 1024 tokens, 1280 channels, the feed-forward's 1280 -> 4 x 1280), Flux at 1024^2
# (4096 image tokens, hidden 3072: attention projections 3072 -> 3072, the MLP's 3072 -> 4 x 3072)
FULL = {"sd15 attn c320": (2 * 4096, 320, 320), "sdxl ff c1280": (2 * 1024, 1280, 5120),
        "flux attn 3072": (2 * 4096, 3072, 3072), "flux mlp 3072": (2 * 4096, 3072, 12288)}
SMALL = {"odd small": (37, 45, 29)}
OPS = {"int8_weight_linear": (int8_weight_linear_ref, int8_weight_linear, torch.int8),
       "int8_dynamic_linear": (int8_dynamic_linear_ref, int8_dynamic_linear, torch.int8),
       "fp8_weight_linear": (fp8_weight_linear_ref, fp8_weight_linear, torch.float8_e4m3fn)}


def quantize_weight(w: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per output channel (amax / 127), or float8 e4m3 per tensor (amax / 448), as compiler/quantize stores them."""
    if storage == torch.int8:
        scale = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
        return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale
    scale = (w.float().abs().amax() / 448).clamp_min(1e-12)
    return (w.float() / scale).clamp(-448, 448).to(storage), scale


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--small", action="store_true", help="tiny shapes: a quick CPU check that this still runs")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.device == "cpu":
        dtype = torch.float32
    reps = 5 if args.small else 100
    rows = []
    for label, (M, K, N) in (SMALL if args.small else FULL).items():
        x = torch.randn(M, K, device=args.device, dtype=dtype)
        w = torch.randn(N, K, device=args.device) / K ** 0.5
        bias = torch.randn(N, device=args.device, dtype=dtype)
        w_dense = w.to(dtype)
        dense_ms = median_ms(lambda: F.linear(x, w_dense, bias), args.device, reps=reps)
        for name, (ref, op, storage) in OPS.items():
            weight, scale = quantize_weight(w, storage)
            for row in compare(name, [(f"{label} {M}x{K}->{N}", (x, weight, scale, bias))], ref, op, args.device, reps):
                rows.append({**row, "dense_ms": dense_ms})
        torch._dynamo.reset()  # each shape compiles its references afresh; no recompile limit across shapes
    print_rows(rows)
    print(f"{'kernel':<22}{'shape':<34}{'dense ms':>10}{'kiln vs dense':>15}")
    for r in rows:
        ratio = f"{r['dense_ms'] / r['kiln_ms']:.2f}x" if r.get("kiln_ms") else "-"
        print(f"{r['kernel']:<22}{r['shape']:<34}{r['dense_ms']:>10.3f}{ratio:>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
