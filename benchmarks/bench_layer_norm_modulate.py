"""Benchmark kiln::layer_norm_modulate against eager and Inductor at the DiT shapes of Flux, SD3
and PixArt at 1024^2 (4096 image tokens).

Two sets of rows: the norm + modulation alone, and with the residual update that precedes it in
every DiT block (`x = x + gate * attn_out`). Inductor fuses that residual into its norm kernel;
with the Kiln op the residual is a kernel of its own. The second set says whether the kernel
should also fire in modes balanced/max (`passes: {fuse_adaln_modulation: on}`) or, as by
default, only in mode fast.

    python -m kiln.benchmarks.bench_layer_norm_modulate --device cuda --dtype bf16 [--json PATH]
    python -m kiln.benchmarks.bench_layer_norm_modulate --small   # CPU smoke run (the op runs its reference)
"""
from __future__ import annotations

import argparse
import json

import torch

from ..kernels import layer_norm_modulate, layer_norm_modulate_ref
from .kernel_timing import compare, print_rows

# (batch, tokens, channels): Flux-dev (no CFG; image and text streams), SD3-medium and PixArt-alpha with CFG
FULL = {"flux img": (1, 4096, 3072), "flux txt": (1, 512, 3072), "sd3 img": (2, 4096, 1536), "pixart": (2, 4096, 1152)}
SMALL = {"odd small": (2, 37, 45)}


def _modulation_inputs(shape, device, dtype):
    batch, _, channels = shape
    x = torch.randn(shape, device=device, dtype=dtype)
    scale = 1 + 0.1 * torch.randn(batch, 1, channels, device=device, dtype=dtype)
    shift = torch.randn(batch, 1, channels, device=device, dtype=dtype)
    return x, scale, shift


def norm_modulate_ref(x, scale, shift):
    return layer_norm_modulate_ref(x, None, None, 1e-6, scale, shift)


def norm_modulate_kiln(x, scale, shift):
    return layer_norm_modulate(x, None, None, 1e-6, scale, shift)


def with_residual(norm_modulate):
    """The DiT step around it: `x = x + gate * attn_out`, then norm + modulation of the new x."""
    def step(x, gate, attn_out, scale, shift):
        x = x + gate * attn_out
        return x, norm_modulate(x, scale, shift)
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--small", action="store_true", help="tiny shapes: a quick CPU check that this still runs")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    reps = 5 if args.small else 100
    shapes = SMALL if args.small else FULL
    alone, residual_cases = [], []
    for name, shape in shapes.items():
        x, scale, shift = _modulation_inputs(shape, args.device, dtype)
        alone.append((f"{name} {shape}", (x, scale, shift)))
        gate = torch.randn_like(scale)
        residual_cases.append((f"{name} +residual", (x, gate, torch.randn_like(x), scale, shift)))
    rows = compare("layer_norm_modulate", alone, norm_modulate_ref, norm_modulate_kiln, args.device, reps)
    # kiln here = what Inductor builds around the op when the pass is forced on in balanced mode
    rows += compare("layer_norm_modulate", residual_cases, with_residual(norm_modulate_ref),
                    torch.compile(with_residual(norm_modulate_kiln)), args.device, reps)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
