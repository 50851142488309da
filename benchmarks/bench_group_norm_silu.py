"""Benchmark kiln::group_norm_silu against eager and Inductor at SD1.5/SDXL ResBlock shapes.

    python -m kiln.benchmarks.bench_group_norm_silu --device cuda --dtype fp16 [--channels-last] [--json PATH]
    python -m kiln.benchmarks.bench_group_norm_silu --small   # CPU smoke run (the op runs its reference)
"""
from __future__ import annotations

import argparse
import json

import torch

from ..kernels import group_norm_silu, group_norm_silu_ref
from .kernel_timing import compare, print_rows

FULL = {"sd15 64x64 c320": (2, 320, 64, 64), "sd15 8x8 c1280": (2, 1280, 8, 8),
        "sdxl 128x128 c320": (2, 320, 128, 128), "sdxl 64x64 c640": (2, 640, 64, 64)}
SMALL = {"odd small": (2, 12, 9, 11)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a quick CPU check that this still runs")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    groups = 4 if args.small else 32
    cases = []
    for name, shape in (SMALL if args.small else FULL).items():
        x = torch.randn(shape, device=args.device, dtype=dtype).contiguous(memory_format=fmt)
        w, b = torch.randn(shape[1], device=args.device, dtype=dtype), torch.randn(shape[1], device=args.device, dtype=dtype)
        cases.append((f"{name} {shape}", (x, groups, w, b, 1e-5)))
    rows = compare("group_norm_silu", cases, group_norm_silu_ref, group_norm_silu, args.device, reps=5 if args.small else 100)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
