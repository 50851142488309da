"""Training the tiny denoisers Kiln measures the step cache on, and keeping them in the user's cache.

One loop for every one of them (testing/digits_unet.py, shapes_unet.py, textures_dit.py): each says
how a batch is drawn (`batch(n)` -> the model's inputs and the target) and this does the rest:
AdamW with a one-cycle schedule, autograd on whatever mode the caller runs in, a running mean of
the loss, and (where the model asks for it) an exponential moving average of the weights, which is
what the model is then: `ema_decay` per step, the average smoothing out the last steps' noise so
that fewer steps train a denoiser whose outputs change smoothly from step to step. `load_or_train` keeps the weights outside the repository, under `cache_dir()`
(~/.cache/kiln/, or $XDG_CACHE_HOME/kiln/), one file per model and version, written atomically; a process that finds another training it waits for
that one's model.
"""
from __future__ import annotations

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

log = logging.getLogger("kiln")

TRAIN_TIMESTEPS = 1000    # SD1.5's DDPM schedule
CFG_DROP = 0.1            # share of a batch trained as the unconditional branch (classifier-free guidance)
LR = 2e-3

Batch = Callable[[int], tuple[tuple, torch.Tensor]]   # n -> (the model's inputs, the target)
Progress = Callable[[int, float], None]               # (step, running loss), every 100 steps


def cache_dir(base: Optional[Path] = None) -> Path:
    return Path(base or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln")


def ddpm_alphas() -> torch.Tensor:
    """SD1.5's cumulative alphas: scaled-linear betas from 0.00085 to 0.012 over TRAIN_TIMESTEPS."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, TRAIN_TIMESTEPS, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).float()


def channel_mixes(kinds: int, seed: int) -> torch.Tensor:
    """(kinds, 4) in [-0.8, 0.8]: how each kind of a drawn data set spreads over the 4 latent channels
    (fixed by `seed`, not by the global generator)."""
    return torch.rand(kinds, 4, generator=torch.Generator().manual_seed(seed)) * 1.6 - 0.8


def drop_classes(classes: torch.Tensor, null_class: int) -> torch.Tensor:
    """`classes` with CFG_DROP of them, at random, the unconditional one."""
    classes = classes.clone()
    classes[torch.rand(len(classes)) < CFG_DROP] = null_class
    return classes


def ddpm_batch(x0: torch.Tensor, alphas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noised x0, timesteps, the noise): epsilon prediction's training example at random timesteps."""
    t = torch.randint(0, TRAIN_TIMESTEPS, (len(x0),))
    a = alphas[t].reshape(-1, *[1] * (x0.dim() - 1))
    noise = torch.randn_like(x0)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise, t, noise


@dataclass
class TrainReport:
    steps: int
    seconds: float
    final_loss: float


def train(build: Callable[[], torch.nn.Module], batch: Batch, steps: int, batch_size: int, seed: int = 0,
          progress: Optional[Progress] = None, ema_decay: Optional[float] = None
          ) -> tuple[torch.nn.Module, TrainReport]:
    """`build()`'s model (built after the seed is set) trained for `steps` on `batch(batch_size)`'s
    examples (MSE to the target); returned in eval mode without gradients. With `ema_decay` the
    returned weights are the moving average (`average += (1 - ema_decay) * (weights - average)` after
    every step, starting from the first step's weights), not the last step's."""
    # with autograd on, also where the caller runs without it (Kiln's tests do) or in inference mode
    # (where enable_grad alone still makes inference tensors, weights and data, that backward refuses)
    with torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(seed)
        model = build().train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps, pct_start=0.1)
        start = time.perf_counter()
        ema = None
        average = None
        for step in range(steps):
            inputs, target = batch(batch_size)
            loss = torch.nn.functional.mse_loss(model(*inputs), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if ema_decay is not None:
                average = _moving_average(model, average, ema_decay)
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            if progress is not None and (step + 1) % 100 == 0:
                progress(step + 1, ema)
        if average is not None:
            with torch.no_grad():
                for weight, averaged in zip(model.parameters(), average):
                    weight.copy_(averaged)
    return model.eval().requires_grad_(False), TrainReport(steps, time.perf_counter() - start, ema)


def _moving_average(model: torch.nn.Module, average: Optional[list[torch.Tensor]], decay: float
                    ) -> list[torch.Tensor]:
    """The weights' moving average after one more step: a copy of them at the first."""
    with torch.no_grad():
        if average is None:
            return [p.detach().clone() for p in model.parameters()]
        for averaged, weight in zip(average, model.parameters()):
            averaged.lerp_(weight, 1 - decay)
    return average


def load_or_train(path: Path, empty: Callable[[], torch.nn.Module],
                  trained: Callable[[Progress], tuple[torch.nn.Module, TrainReport]], what: str,
                  progress: Optional[Progress] = None) -> torch.nn.Module:
    """The model at `path` (its weights loaded into `empty()`), trained by `trained(progress)` and stored
    there first if missing, with its TrainReport beside it (.json); `progress` defaults to a log line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with training_lock(path):  # a second process waits for the first's model instead of training its own
        model = empty()
        if path.exists():
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return model.eval().requires_grad_(False)
        log.info("Kiln: training the tiny %s once (a few CPU minutes) into %s", what, path)
        model, report = trained(progress or (lambda step, loss: log.info("Kiln: %s step %d, loss %.4f", what, step, loss)))
        _store(model, report, path)
    return model


@contextlib.contextmanager
def training_lock(path: Path):
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


def _store(model: torch.nn.Module, report: TrainReport, path: Path) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes training at once each write their own
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps(report.__dict__))


def main(name: str, cache_path: Callable[[Optional[Path]], Path],
         load: Callable[[Optional[Path], Optional[Progress]], torch.nn.Module], argv=None) -> int:
    """A model module's command line: train it once into the cache (or --cache-dir)."""
    import argparse

    parser = argparse.ArgumentParser(description=f"Train the tiny {name} into Kiln's cache (once).")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    load(args.cache_dir, lambda step, loss: print(f"step {step}, loss {loss:.4f}", flush=True))
    print(f"{cache_path(args.cache_dir)}: ready")
    return 0
