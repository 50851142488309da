"""How close an image (or latent) is to its reference: what the step cache's tests and benches compare."""
from __future__ import annotations

import math

import torch


def psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB over the reference's own range (peak to peak); infinite when equal."""
    mse = (out.float() - ref.float()).pow(2).mean().item()
    peak = (ref.max() - ref.min()).item()
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)
