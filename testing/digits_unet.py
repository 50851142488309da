"""A trained tiny denoiser for measuring what depends on a trained model (the step cache's quality).

Random weights make every step-cache decision meaningless: their outputs do not settle as sampling
converges. This trains the tiny SD1.5-architecture UNet (testing/models.py, `sd15` at size tiny) to
denoise "latents" made from scikit-learn's bundled digits (1797 8x8 images, no download): each digit
an 8x8 latent (a 64x64 image's), spread over the 4 latent channels, conditioned on its class through the
cross-attention input (a learned embedding per class, one more for the unconditional branch of CFG).
Epsilon prediction on SD1.5's DDPM schedule (1000 steps, scaled-linear betas), a few CPU minutes,
cached outside the repository:

    python -m kiln.testing.digits_unet            # trains once into ~/.cache/kiln/ (or $XDG_CACHE_HOME/kiln/)

`load_or_train()` returns the model; `sample()` runs DDIM with classifier-free guidance on it, the
sampling loop the step cache is measured in. Needs scikit-learn (the `dev` extra).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from . import denoiser_training
from .denoiser_training import Progress, TrainReport
from .models import MODELS

VERSION = 3               # bump when the data, model or training change: a new cache file
LATENT = 8                # latent side: the digits' own 8x8
CHANNEL_MIX = (1.0, -0.6, 0.8, 0.3)   # how a digit spreads over the 4 latent channels
TRAIN_TIMESTEPS = denoiser_training.TRAIN_TIMESTEPS
NULL_CLASS = 10           # the unconditional embedding
TRAIN_STEPS = 300         # of TRAIN_BATCH examples each...
TRAIN_BATCH = 64
EMA_DECAY = 0.98          # ...and the weights' moving average taken (tests/step_cache's 30 dB bars hold on it)


def _alphas_cumprod() -> torch.Tensor:
    return denoiser_training.ddpm_alphas()


def digit_latents() -> tuple[torch.Tensor, torch.Tensor]:
    """(latents (1797, 4, 8, 8) in about [-1, 1], classes (1797,))."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 8.0 - 1.0   # 0..16 -> -1..1
    mix = torch.tensor(CHANNEL_MIX).reshape(1, 4, 1, 1)
    return images * mix, torch.tensor(digits.target, dtype=torch.long)


class DigitsDenoiser(torch.nn.Module):
    """The UNet and its class embeddings: `forward(x, t, classes)`; classes NULL_CLASS for uncond.
    `DigitsDenoiser(kiln.compile(trained.unet), trained.embed)` is the trained one, compiled."""

    def __init__(self, unet: Optional[torch.nn.Module] = None, embed: Optional[torch.nn.Embedding] = None,
                 null_class: int = NULL_CLASS):
        super().__init__()
        self.unet = unet if unet is not None else MODELS["sd15"].build("tiny").requires_grad_(True)
        if embed is None:
            embed = torch.nn.Embedding(null_class + 1, self.unet.config.cross_attention_dim)
        self.embed = embed

    def context(self, classes: torch.Tensor) -> torch.Tensor:
        return self.embed(classes)[:, None]

    def forward(self, x: torch.Tensor, t: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        return self.unet(x, t, encoder_hidden_states=self.context(classes), return_dict=False)[0]


def cache_path(cache_dir: Optional[Path] = None) -> Path:
    return denoiser_training.cache_dir(cache_dir) / f"digits-unet-v{VERSION}.pt"


def train(steps: int = TRAIN_STEPS, batch: int = TRAIN_BATCH, seed: int = 0, progress: Optional[Progress] = None
          ) -> tuple[DigitsDenoiser, TrainReport]:
    latents, classes = digit_latents()
    alphas = _alphas_cumprod()

    def examples(n: int):
        idx = torch.randint(0, len(latents), (n,))
        c = denoiser_training.drop_classes(classes[idx], NULL_CLASS)  # CFG: learn the unconditional branch too
        noised, t, noise = denoiser_training.ddpm_batch(latents[idx], alphas)
        return (noised, t, c), noise

    return denoiser_training.train(DigitsDenoiser, examples, steps, batch, seed, progress, ema_decay=EMA_DECAY)


def load_or_train(cache_dir: Optional[Path] = None, progress: Optional[Progress] = None) -> DigitsDenoiser:
    """The trained model from the cache, trained and stored there first if missing; `progress(step, loss)`
    every 100 steps of that (default: a log line)."""
    return denoiser_training.load_or_train(cache_path(cache_dir), DigitsDenoiser, lambda p: train(progress=p),
                                           "digits denoiser", progress)


def sample(model: Callable, classes: torch.Tensor, steps: int, seed: int, guidance: float = 4.0,
           latent: int = LATENT, null_class: int = NULL_CLASS) -> torch.Tensor:
    """DDIM (eta 0) with classifier-free guidance, cond and uncond in one batch: `model(x, t, classes)`
    is called once per step with the batch doubled (what the step cache sees), `null_class` the
    unconditional branch's. Returns the latents."""
    alphas = _alphas_cumprod()
    generator = torch.Generator().manual_seed(seed)
    n = len(classes)
    x = torch.randn(n, 4, latent, latent, generator=generator)
    timesteps = torch.linspace(TRAIN_TIMESTEPS - 1, 0, steps).round().long()
    both = torch.cat([classes, torch.full_like(classes, null_class)])
    for i, t in enumerate(timesteps):
        eps_c, eps_u = model(torch.cat([x, x]), t.repeat(2 * n), both).chunk(2)
        eps = eps_u + guidance * (eps_c - eps_u)
        a = alphas[t]
        a_next = alphas[timesteps[i + 1]] if i + 1 < steps else torch.tensor(1.0)
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
    return x


def main(argv=None) -> int:
    return denoiser_training.main("digits denoiser", cache_path, load_or_train, argv)


if __name__ == "__main__":
    raise SystemExit(main())
