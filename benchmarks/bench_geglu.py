"""Benchmark kiln::geglu against eager and Inductor at the feed-forward shapes of SD1.5 and SDXL.

    python -m kiln.benchmarks.bench_geglu --device cuda --dtype fp16 [--json PATH]
    python -m kiln.benchmarks.bench_geglu --small        # CPU smoke run (the op runs its reference)
"""
from __future__ import annotations

import argparse
import json

import torch

from ..kernels import geglu, geglu_ref
from .kernel_timing import compare, print_rows

# (batch x tokens, 2 x inner): SD1.5 at 512^2 with CFG (64x64 latent -> 4096 tokens, inner 4x320..4x1280),
# SDXL at 1024^2 (128x128 latent, level 2 at 4096 tokens with inner 4x640, level 3 at 1024 tokens with 4x1280)
FULL = {"sd15 64x64 c320": (2, 4096, 2 * 1280), "sd15 16x16 c1280": (2, 256, 2 * 5120),
        "sdxl 64x64 c640": (2, 4096, 2 * 2560), "sdxl 32x32 c1280": (2, 1024, 2 * 5120)}
SMALL = {"odd small": (2, 37, 2 * 45)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--small", action="store_true", help="tiny shapes: a quick CPU check that this still runs")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.device == "cpu":
        dtype = torch.float32
    shapes = SMALL if args.small else FULL
    cases = [(f"{k} {v}", (torch.randn(v, device=args.device, dtype=dtype),)) for k, v in shapes.items()]
    rows = compare("geglu", cases, geglu_ref, geglu, args.device, reps=5 if args.small else 100)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
