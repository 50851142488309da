"""`StepCachedModel`: a diffusion model called as `model(x, timestep, ...)` behind a StepCache.

For Python sampling loops (diffusers-style models and schedulers). The run's progress is the step's
place in the run where the run's `timesteps` are given (`step_cached(..., timesteps=scheduler.timesteps)`,
or `set_timesteps` before each run): step i of n is at i / n, the last at 1, as ComfyUI's node counts
it, so start_percent and end_percent are shares of the steps whatever the schedule (a flow model's
shifted sigmas crowd its first steps near sigma 1). Without them it comes from the timestep,
`1 - timestep / num_train_timesteps` (1000 for SD1.5/SDXL's DDPM schedules, 1 for a flow model whose
timesteps are sigmas in [0, 1]). A run starts again when its progress goes back. Wrap a compiled model
(`step_cached(kiln.compile(unet))`) or an eager one: the cache decides outside the model either way.
ComfyUI's node resets the cache per sampling run itself (nodes/).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .first_block_probe import first_block_of, first_block_probed
from .decision import StepCache, StepCacheError, StepCacheOptions, StepCacheReport

MAX_TIMESTEPS = 10_000  # a run's timesteps at most (a schedule is a few hundred steps at the very most)


class StepCachedModel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, options: Optional[StepCacheOptions] = None,
                 num_train_timesteps: float = 1000, timesteps: Optional[Sequence[float]] = None):
        super().__init__()
        if not num_train_timesteps > 0:
            raise StepCacheError(f"num_train_timesteps={num_train_timesteps!r}: use a positive number")
        self.module = module
        self.cache = StepCache(options)
        self.num_train_timesteps = float(num_train_timesteps)
        self.timesteps: Optional[torch.Tensor] = None
        if timesteps is not None:
            self.set_timesteps(timesteps)
        self._returns_tuple = False  # diffusers' return_dict=False: answer a skipped step the same way
        # method first_block: the block whose residual decides (found now: a model without blocks is refused here)
        self._first_block = first_block_of(module)[1] if self.cache.options.method == "first_block" else None

    def set_timesteps(self, timesteps: Optional[Sequence[float]]) -> None:
        """The timesteps of the coming runs, in the order the sampler calls them (None: progress from the
        timestep itself); a call's step is the nearest of them."""
        if timesteps is None:
            self.timesteps = None
            return
        steps = torch.as_tensor(timesteps, dtype=torch.float64).detach().cpu().flatten()
        if not 1 <= len(steps) <= MAX_TIMESTEPS or not bool(torch.isfinite(steps).all()):
            raise StepCacheError(f"timesteps: use 1 to {MAX_TIMESTEPS} finite numbers, not {len(steps)} "
                                 f"{'' if bool(torch.isfinite(steps).all()) else 'with a non-finite one'}")
        self.timesteps = steps

    def progress(self, t: float) -> float:
        """The run's progress at timestep `t`: its step's share of the run (the last step 1), or
        `1 - t / num_train_timesteps` without timesteps."""
        if self.timesteps is None:
            return 1.0 - t / self.num_train_timesteps
        step = int((self.timesteps - t).abs().argmin())
        return 1.0 if step == len(self.timesteps) - 1 else step / len(self.timesteps)

    def forward(self, x: torch.Tensor, timestep: Union[torch.Tensor, float], *args, **kwargs):
        t = float(timestep.max()) if isinstance(timestep, torch.Tensor) else float(timestep)

        def compute() -> torch.Tensor:
            if self._first_block is None:
                out = self.module(x, timestep, *args, **kwargs)
            else:
                with first_block_probed(self.cache, self._first_block):
                    out = self.module(x, timestep, *args, **kwargs)
            self._returns_tuple = isinstance(out, tuple)
            if self._returns_tuple:
                return out[0]
            if not isinstance(out, torch.Tensor):
                raise StepCacheError(f"step cache: the model returned {type(out).__name__}; call it with "
                                     "return_dict=False (a tensor or a tuple whose first item is one)")
            return out

        out = self.cache.step(x, self.progress(t), compute, time=t)
        return (out,) if self._returns_tuple else out

    def report(self) -> StepCacheReport:
        """The run in progress (or the last, right after a run ends and before the next starts)."""
        return self.cache.report()


def step_cached(module: torch.nn.Module, options: Union[StepCacheOptions, dict, None] = None,
                num_train_timesteps: float = 1000, timesteps: Optional[Sequence[float]] = None) -> StepCachedModel:
    """`module` behind a step cache (compiler/step_cache/decision.py); `options` a StepCacheOptions or a mapping;
    `timesteps` the run's, for progress by steps (see the module docstring)."""
    if isinstance(options, dict):
        options = StepCacheOptions.from_mapping(options)
    return StepCachedModel(module, options, num_train_timesteps, timesteps)
