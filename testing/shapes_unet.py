"""A second trained SD1.5-layout denoiser, on data nobody tuned the step cache to: drawn shapes.

The tiny SD1.5-architecture UNet (testing/models.py, `sd15` at size tiny: cross-attention on a
class embedding, as testing/digits_unet.py) trained to denoise 8x8 "latents" of procedurally drawn
shapes: SHAPES kinds (disk, square, triangle, ring, cross, stripes both ways, checker), each at a
random place and size, spread over the 4 latent channels by a mix of its own. Nothing is
downloaded; every batch is drawn afresh. Epsilon prediction on SD1.5's DDPM schedule with the
training loop of testing/denoiser_training.py, cached outside the repository:

    python -m kiln.testing.shapes_unet            # trains once into ~/.cache/kiln/ (or $XDG_CACHE_HOME/kiln/)

`sample()` is digits_unet's DDIM with classifier-free guidance, at this model's size.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from . import denoiser_training, digits_unet
from .denoiser_training import Progress, TrainReport

VERSION = 1               # bump when the data, model or training change: a new cache file
LATENT = 8
SHAPES = ("disk", "square", "triangle", "ring", "cross", "rows", "columns", "checker")
NULL_CLASS = len(SHAPES)  # the unconditional embedding
TRAIN_STEPS = 300         # about 4 minutes on 2 busy cores
TRAIN_BATCH = 16


def _mixes() -> torch.Tensor:
    return denoiser_training.channel_mixes(len(SHAPES), seed=1)


def shape_latents(classes: torch.Tensor) -> torch.Tensor:
    """(n, 4, LATENT, LATENT) in about [-1, 1]: one shape of each given kind at a random place and size
    (torch's global generator)."""
    n = len(classes)
    side = torch.linspace(-1, 1, LATENT)
    yy, xx = side[:, None].expand(LATENT, LATENT), side[None, :].expand(LATENT, LATENT)
    cx, cy = [torch.rand(n, 1, 1) * 0.8 - 0.4 for _ in range(2)]
    r = torch.rand(n, 1, 1) * 0.3 + 0.35
    freq = torch.rand(n, 1, 1) * 4 + 5
    dx, dy = xx - cx, yy - cy
    dist = (dx * dx + dy * dy).sqrt()
    masks = torch.stack([
        dist < r,
        torch.maximum(dx.abs(), dy.abs()) < 0.8 * r,
        (dy < 0.6 * r) & (dx.abs() < (dy + 0.8 * r) * 0.6),
        (dist - 0.8 * r).abs() < 0.16,
        ((dx.abs() < 0.15) | (dy.abs() < 0.15)) & (torch.maximum(dx.abs(), dy.abs()) < r),
        torch.sin(yy * freq + cy * 10) > 0,
        torch.sin(xx * freq + cx * 10) > 0,
        torch.sin(xx * freq * 0.6 + cx * 10) * torch.sin(yy * freq * 0.6 + cy * 10) > 0,
    ], 1).float()                                                    # (n, kinds, L, L)
    mask = masks[torch.arange(n), classes]                           # (n, L, L)
    return (mask * 2 - 1)[:, None] * _mixes()[classes][:, :, None, None]


def denoiser(unet: Optional[torch.nn.Module] = None, embed: Optional[torch.nn.Embedding] = None
             ) -> digits_unet.DigitsDenoiser:
    """The UNet and its class embeddings, as digits_unet's: `forward(x, t, classes)`, NULL_CLASS for uncond."""
    return digits_unet.DigitsDenoiser(unet, embed, null_class=NULL_CLASS)


def cache_path(cache_dir: Optional[Path] = None) -> Path:
    return denoiser_training.cache_dir(cache_dir) / f"shapes-unet-v{VERSION}.pt"


def train(steps: int = TRAIN_STEPS, batch: int = TRAIN_BATCH, seed: int = 0, progress: Optional[Progress] = None
          ) -> tuple[torch.nn.Module, TrainReport]:
    alphas = denoiser_training.ddpm_alphas()

    def examples(n: int):
        classes = torch.randint(0, len(SHAPES), (n,))
        noised, t, noise = denoiser_training.ddpm_batch(shape_latents(classes), alphas)
        return (noised, t, denoiser_training.drop_classes(classes, NULL_CLASS)), noise

    return denoiser_training.train(denoiser, examples, steps, batch, seed, progress)


def load_or_train(cache_dir: Optional[Path] = None, progress: Optional[Progress] = None) -> torch.nn.Module:
    return denoiser_training.load_or_train(cache_path(cache_dir), denoiser, lambda p: train(progress=p),
                                           "shapes denoiser", progress)


def sample(model: Callable, classes: torch.Tensor, steps: int, seed: int, guidance: float = 4.0) -> torch.Tensor:
    """DDIM with classifier-free guidance (digits_unet.sample) at LATENT; classes index SHAPES."""
    return digits_unet.sample(model, classes % len(SHAPES), steps, seed, guidance, LATENT, NULL_CLASS)


def main(argv=None) -> int:
    return denoiser_training.main("shapes denoiser", cache_path, load_or_train, argv)


if __name__ == "__main__":
    raise SystemExit(main())
