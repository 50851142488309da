"""A trained Flux-style transformer, on data nobody tuned the step cache to: procedural textures.

The tiny Flux transformer (testing/models.py, `flux` at size tiny: double and single blocks, rotary
positions, a pooled and a token conditioning) trained by flow matching (rectified flow, as Flux and
SD3: `x_s = (1 - s) x0 + s noise`, the model predicts `noise - x0`, its timestep is `s`) to denoise
16x16x4 "latents" of textures, packed 2x2 into 64 tokens of 16 channels as Flux packs its latents:
TEXTURES kinds (gratings at four angles, rings, spokes, blobs, plaid), each with a random
frequency and phase, spread over the 4 channels by a mix of its own. Nothing is downloaded; every
batch is drawn afresh. The training loop is testing/denoiser_training.py's; cached outside the
repository:

    python -m kiln.testing.textures_dit           # trains once into ~/.cache/kiln/ (or $XDG_CACHE_HOME/kiln/)

`sample()` runs Euler on a shifted sigma schedule (SHIFT, unevenly spaced, as Flux's) with
classifier-free guidance, cond and uncond in one batch; the model is called with the sigma as its
timestep (`step_cached(model, num_train_timesteps=1)`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import torch

from . import denoiser_training
from .denoiser_training import Progress, TrainReport
from .models import MODELS

VERSION = 1               # bump when the data, model or training change: a new cache file
LATENT = 16               # the latent's side; packed 2x2, an 8x8 grid of tokens
TEXTURES = ("grating 0", "grating 45", "grating 90", "grating 135", "rings", "spokes", "blobs", "plaid")
NULL_CLASS = len(TEXTURES)  # the unconditional embedding
SHIFT = 2.0               # the sigma schedule's shift (Flux's and SD3's time shift): more steps at high noise
TRAIN_STEPS = 600         # about 4 minutes on 2 busy cores
TRAIN_BATCH = 16


def _mixes() -> torch.Tensor:
    return denoiser_training.channel_mixes(len(TEXTURES), seed=2)


def texture_latents(classes: torch.Tensor) -> torch.Tensor:
    """(n, 4, LATENT, LATENT) in [-1, 1]: a texture of each given kind, random frequency and phase
    (torch's global generator)."""
    n = len(classes)
    side = torch.linspace(-1, 1, LATENT)
    yy, xx = side[:, None].expand(LATENT, LATENT), side[None, :].expand(LATENT, LATENT)
    freq = torch.rand(n, 1, 1) * 3 + 3
    phase = torch.rand(n, 1, 1) * 2 * math.pi
    cx, cy = [torch.rand(n, 1, 1) * 0.6 - 0.3 for _ in range(2)]
    dx, dy = xx - cx, yy - cy
    blobs = sum(torch.exp(-((xx - torch.rand(n, 1, 1) * 1.6 + 0.8) ** 2 + (yy - torch.rand(n, 1, 1) * 1.6 + 0.8) ** 2)
                          / 0.08) for _ in range(3))
    diag = 0.5 ** 0.5
    kinds = torch.stack([
        torch.sin(xx * freq + phase),
        torch.sin((xx + yy) * diag * freq + phase),
        torch.sin(yy * freq + phase),
        torch.sin((xx - yy) * diag * freq + phase),
        torch.sin((dx * dx + dy * dy).sqrt() * freq * 1.5 + phase),
        torch.sin(torch.atan2(dy, dx) * torch.floor(freq) + phase),
        blobs.clamp(max=1) * 2 - 1,
        0.5 * (torch.sin(xx * freq + phase) + torch.sin(yy * freq * 0.7 - phase)),
    ], 1)                                                            # (n, kinds, L, L)
    return kinds[torch.arange(n), classes][:, None] * _mixes()[classes][:, :, None, None]


def pack(x: torch.Tensor) -> torch.Tensor:
    """(n, 4, H, W) -> (n, H/2 * W/2, 16): Flux's 2x2 packing of a latent into tokens."""
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, h * w // 4, c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    n, _, d = tokens.shape
    return tokens.reshape(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, d // 4, h, w)


class TexturesDenoiser(torch.nn.Module):
    """The transformer and its class embeddings (a token and a pooled vector): `forward(x, sigma, classes)`
    on (n, 4, H, W) latents, the velocity `noise - x0`; classes NULL_CLASS for uncond.
    `TexturesDenoiser(kiln.compile(trained.transformer), trained.token, trained.pooled)` is the trained one, compiled."""

    def __init__(self, transformer: Optional[torch.nn.Module] = None, token: Optional[torch.nn.Embedding] = None,
                 pooled: Optional[torch.nn.Embedding] = None):
        super().__init__()
        self.transformer = transformer if transformer is not None else MODELS["flux"].build("tiny").requires_grad_(True)
        config = self.transformer.config
        self.token = token if token is not None else torch.nn.Embedding(NULL_CLASS + 1, config.joint_attention_dim)
        self.pooled = pooled if pooled is not None else torch.nn.Embedding(NULL_CLASS + 1, config.pooled_projection_dim)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        return velocity(self.transformer, x, sigma, self.token(classes)[:, None], self.pooled(classes))


def velocity(transformer: Callable, x: torch.Tensor, sigma: torch.Tensor, token: torch.Tensor, pooled: torch.Tensor
             ) -> torch.Tensor:
    """The transformer's output for (n, 4, H, W) latents at `sigma`, conditioned on (n, 1, D) `token` states
    and (n, P) `pooled` vectors, unpacked to the latents' shape."""
    _, _, h, w = x.shape
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(x.dtype)
    out = transformer(hidden_states=pack(x), encoder_hidden_states=token, pooled_projections=pooled,
                      timestep=sigma.to(x.dtype), img_ids=img_ids, txt_ids=torch.zeros(1, 3, dtype=x.dtype),
                      return_dict=False)[0]
    return unpack(out, h, w)


def cache_path(cache_dir: Optional[Path] = None) -> Path:
    return denoiser_training.cache_dir(cache_dir) / f"textures-dit-v{VERSION}.pt"


def train(steps: int = TRAIN_STEPS, batch: int = TRAIN_BATCH, seed: int = 0, progress: Optional[Progress] = None
          ) -> tuple[torch.nn.Module, TrainReport]:
    def examples(n: int):
        classes = torch.randint(0, len(TEXTURES), (n,))
        x0 = texture_latents(classes)
        s = torch.rand(n)
        noise = torch.randn_like(x0)
        noised = (1 - s).reshape(-1, 1, 1, 1) * x0 + s.reshape(-1, 1, 1, 1) * noise
        return (noised, s, denoiser_training.drop_classes(classes, NULL_CLASS)), noise - x0

    return denoiser_training.train(TexturesDenoiser, examples, steps, batch, seed, progress)


def load_or_train(cache_dir: Optional[Path] = None, progress: Optional[Progress] = None) -> torch.nn.Module:
    return denoiser_training.load_or_train(cache_path(cache_dir), TexturesDenoiser, lambda p: train(progress=p),
                                           "textures transformer", progress)


def sigmas(steps: int) -> torch.Tensor:
    """steps + 1 sigmas from 1 to 0, shifted by SHIFT (`shift s / (1 + (shift - 1) s)`): unevenly spaced."""
    s = torch.linspace(1, 0, steps + 1)
    return SHIFT * s / (1 + (SHIFT - 1) * s)


def sample(model: Callable, classes: torch.Tensor, steps: int, seed: int, guidance: float = 4.0) -> torch.Tensor:
    """Euler on `sigmas(steps)` with classifier-free guidance, cond and uncond in one batch: `model(x, sigma,
    classes)` is called once per step with the batch doubled. Returns the latents."""
    classes = classes % len(TEXTURES)
    generator = torch.Generator().manual_seed(seed)
    n = len(classes)
    x = torch.randn(n, 4, LATENT, LATENT, generator=generator)
    both = torch.cat([classes, torch.full_like(classes, NULL_CLASS)])
    schedule = sigmas(steps)
    for sigma, sigma_next in zip(schedule[:-1], schedule[1:]):
        v_c, v_u = model(torch.cat([x, x]), sigma.repeat(2 * n), both).chunk(2)
        x = x + (sigma_next - sigma) * (v_u + guidance * (v_c - v_u))
    return x


def main(argv=None) -> int:
    return denoiser_training.main("textures transformer", cache_path, load_or_train, argv)


if __name__ == "__main__":
    raise SystemExit(main())
