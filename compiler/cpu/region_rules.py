"""The region choice's CPU rules (compiler/regional/region_choice.py asks these on a CPU only).

- A block with at least CPU_CONVOLUTION_SHARE of its weights in convolution layers (ResNet blocks,
  Down/Upsample) is not compiled on a CPU: such blocks measured no faster compiled there, and each
  costs seconds to lower (docs/measurements/2026-11-28-cpu-convolutions.md,
  2026-12-02-cpu-seam.md).
- A timing sample of a region on a CPU is as many calls as take MIN_SAMPLE_MS by one eager call, at
  most MAX_CPU_CALLS, and no more than CPU_COPIES_BYTES of input copies: one call of a small block
  is within a CPU's noise.
"""
from __future__ import annotations

import math

import torch

CPU_CONVOLUTION_SHARE = 0.5  # a block with at least this share of its weights in convolutions is not compiled
CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
MIN_SAMPLE_MS = 5.0  # a sample is as many calls as take this long by one eager call ...
MAX_CPU_CALLS = 16   # ... at most this many ...
CPU_COPIES_BYTES = 256 << 20  # ... and no more than their inputs' copies fit in


def convolution_share(block: torch.nn.Module) -> float:
    """The share of `block`'s weight elements held by its convolution layers (torch.nn's, and their
    subclasses: diffusers' and ComfyUI's convolutions are)."""
    total = convolution = 0
    for module in block.modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        total += own
        if isinstance(module, CONVOLUTIONS):
            convolution += own
    return convolution / total if total else 0.0


def eager_before_capture(block: torch.nn.Module, device: str) -> str:
    """Why the region of `block` is not compiled on `device` before anything is captured or measured:
    on a CPU, a block with at least CPU_CONVOLUTION_SHARE of its weights in convolutions ('' when it
    may be, and on any other device)."""
    if device != "cpu":
        return ""
    share = convolution_share(block)
    if share < CPU_CONVOLUTION_SHARE:
        return ""
    return (f"not compiled: on a CPU, a block with {share:.0%} of its weights in convolutions; such blocks "
            f"measured no faster compiled there, and each costs seconds to lower")


def calls_per_sample(input_bytes: int, call_ms: float) -> int:
    """Calls timed together for one sample on a CPU: as many as take MIN_SAMPLE_MS by `call_ms`, one
    eager call's time, at most MAX_CPU_CALLS and no more than CPU_COPIES_BYTES of input copies of
    `input_bytes` each."""
    fit = CPU_COPIES_BYTES // input_bytes if input_bytes else MAX_CPU_CALLS
    return max(1, min(MAX_CPU_CALLS, fit, math.ceil(MIN_SAMPLE_MS / max(call_ms, 1e-3))))
