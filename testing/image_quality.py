"""How close an image (or latent) is to its reference: what the step cache's tests and benches compare."""
from __future__ import annotations

import math

import torch


def psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB over the reference's own range (peak to peak); infinite when equal."""
    mse = (out.float() - ref.float()).pow(2).mean().item()
    peak = (ref.max() - ref.min()).item()
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def ssim(out: torch.Tensor, ref: torch.Tensor, sigma: float = 1.5) -> float:
    """Structural similarity (Wang et al., 2004) of images or latents shaped (..., height, width): a
    Gaussian window (`sigma`, 11 wide or the image's smaller side if less, odd), no padding, the
    reference's peak to peak as the data range; the mean over every window, channel and image. 1 when equal."""
    if out.shape != ref.shape or out.dim() < 2:
        raise ValueError(f"ssim: shapes {tuple(out.shape)} and {tuple(ref.shape)} must match, with height and width")
    height, width = ref.shape[-2:]
    size = min(11, height, width)
    size -= 1 - size % 2
    x = out.detach().float().reshape(-1, 1, height, width)
    y = ref.detach().float().reshape(-1, 1, height, width)
    g = torch.exp(-((torch.arange(size, dtype=torch.float32) - size // 2) ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :])[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(t, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2
    cov = blur(x * y) - mu_x * mu_y
    peak = (y.max() - y.min()).item() or 1.0
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return index.mean().item()


def summary(quality: list[tuple[float, float]]) -> dict:
    """{psnr_min, psnr_mean, ssim_min, ssim_mean} of (PSNR, SSIM) pairs, one per image: a bench row's quality."""
    psnrs, ssims = [q[0] for q in quality], [q[1] for q in quality]
    return {"psnr_min": min(psnrs), "psnr_mean": sum(psnrs) / len(psnrs),
            "ssim_min": min(ssims), "ssim_mean": sum(ssims) / len(ssims)}


def summary_line(row: dict) -> str:
    """'PSNR 30.9 / 36.4 dB  SSIM 0.955 / 0.985': worst / mean, from `summary`'s keys."""
    return (f"PSNR {row['psnr_min']:5.1f} / {row['psnr_mean']:5.1f} dB  "
            f"SSIM {row['ssim_min']:.3f} / {row['ssim_mean']:.3f}")
