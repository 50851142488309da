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

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from .models import MODELS

log = logging.getLogger("kiln")

VERSION = 1               # bump when the data, model or training change: a new cache file
LATENT = 8                # latent side: the digits' own 8x8
CHANNEL_MIX = (1.0, -0.6, 0.8, 0.3)   # how a digit spreads over the 4 latent channels
TRAIN_TIMESTEPS = 1000
NULL_CLASS = 10           # the unconditional embedding


def _alphas_cumprod() -> torch.Tensor:
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, TRAIN_TIMESTEPS, dtype=torch.float64) ** 2  # SD1.5's
    return torch.cumprod(1 - betas, 0).float()


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

    def __init__(self, unet: Optional[torch.nn.Module] = None, embed: Optional[torch.nn.Embedding] = None):
        super().__init__()
        self.unet = unet if unet is not None else MODELS["sd15"].build("tiny").requires_grad_(True)
        if embed is None:
            embed = torch.nn.Embedding(NULL_CLASS + 1, self.unet.config.cross_attention_dim)
        self.embed = embed

    def context(self, classes: torch.Tensor) -> torch.Tensor:
        return self.embed(classes)[:, None]

    def forward(self, x: torch.Tensor, t: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        return self.unet(x, t, encoder_hidden_states=self.context(classes), return_dict=False)[0]


def cache_path(cache_dir: Optional[Path] = None) -> Path:
    base = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    return Path(base) / f"digits-unet-v{VERSION}.pt"


@dataclass
class TrainReport:
    steps: int
    seconds: float
    final_loss: float


def train(steps: int = 2000, batch: int = 64, seed: int = 0, progress: Optional[Callable[[int, float], None]] = None
          ) -> tuple[DigitsDenoiser, TrainReport]:
    # with autograd on, also where the caller runs without it (Kiln's tests do) or in inference mode
    # (where enable_grad alone still makes inference tensors, weights and data, that backward refuses)
    with torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(seed)
        latents, classes = digit_latents()
        model = DigitsDenoiser().train()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
        alphas = _alphas_cumprod()
        start = time.perf_counter()
        loss = _train_steps(model, opt, sched, alphas, latents, classes, steps, batch, progress)
    return model.eval().requires_grad_(False), TrainReport(steps, time.perf_counter() - start, loss)


def _train_steps(model, opt, sched, alphas, latents, classes, steps, batch, progress) -> float:
    """The training loop; the loss at its end (a running mean)."""
    ema = None
    for step in range(steps):
        idx = torch.randint(0, len(latents), (batch,))
        x0, c = latents[idx], classes[idx].clone()
        c[torch.rand(batch) < 0.1] = NULL_CLASS            # CFG: learn the unconditional branch too
        t = torch.randint(0, TRAIN_TIMESTEPS, (batch,))
        a = alphas[t].reshape(-1, 1, 1, 1)
        noise = torch.randn_like(x0)
        loss = torch.nn.functional.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, c), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if progress is not None and (step + 1) % 100 == 0:
            progress(step + 1, ema)
    return ema


def load_or_train(cache_dir: Optional[Path] = None, progress: Optional[Callable[[int, float], None]] = None
                  ) -> DigitsDenoiser:
    """The trained model from the cache, trained and stored there first if missing; `progress(step, loss)`
    every 100 steps of that (default: a log line)."""
    path = cache_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _training_lock(path):  # a second process waits for the first's model instead of training its own
        return _load_or_train_locked(path, progress)


@contextlib.contextmanager
def _training_lock(path: Path):
    """Hold an exclusive flock on `<model>.lock` beside the model (none where there is no flock, as on
    Windows: there two processes may each train, and each writes its own temporary file)."""
    if fcntl is None:
        yield
        return
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load_or_train_locked(path: Path, progress: Optional[Callable[[int, float], None]]) -> DigitsDenoiser:
    model = DigitsDenoiser()
    if path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval().requires_grad_(False)
    log.info("Kiln: training the tiny digits denoiser once (a few CPU minutes) into %s", path)
    model, report = train(progress=progress or (lambda step, loss: log.info("Kiln: digits denoiser step %d, loss %.4f",
                                                                            step, loss)))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes training at once each write their own
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps(report.__dict__))
    return model


def sample(model: Callable, classes: torch.Tensor, steps: int, seed: int, guidance: float = 4.0,
           latent: int = LATENT) -> torch.Tensor:
    """DDIM (eta 0) with classifier-free guidance, cond and uncond in one batch: `model(x, t, classes)`
    is called once per step with the batch doubled (what the step cache sees). Returns the latents."""
    alphas = _alphas_cumprod()
    generator = torch.Generator().manual_seed(seed)
    n = len(classes)
    x = torch.randn(n, 4, latent, latent, generator=generator)
    timesteps = torch.linspace(TRAIN_TIMESTEPS - 1, 0, steps).round().long()
    both = torch.cat([classes, torch.full_like(classes, NULL_CLASS)])
    for i, t in enumerate(timesteps):
        eps_c, eps_u = model(torch.cat([x, x]), t.repeat(2 * n), both).chunk(2)
        eps = eps_u + guidance * (eps_c - eps_u)
        a = alphas[t]
        a_next = alphas[timesteps[i + 1]] if i + 1 < steps else torch.tensor(1.0)
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
    return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Train the tiny digits denoiser into Kiln's cache (once).")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    path = cache_path(args.cache_dir)
    load_or_train(args.cache_dir, progress=lambda step, loss: print(f"step {step}, loss {loss:.4f}", flush=True))
    print(f"{path}: ready")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
