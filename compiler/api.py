"""The public API: `kiln.compile(module, CompileOptions(...), cache=CacheOptions(...))` and
`kiln.stats(compiled)`. No ComfyUI here."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .cache import CacheOptions
from .model import KilnModel, KilnUnavailable, model_for, unavailable_reason
from .options.compile_options import CompileOptions, OptionsError
from .passes import Progress
from .plan import KilnPlan
from .stats import KilnStats
from .step_cache.decision import StepCacheOptions
from .step_cache.step_cached_model import StepCachedModel, step_cached


def compile(module: torch.nn.Module, options: Union[CompileOptions, str] = "balanced", dynamic: Optional[bool] = None,
            cuda_graphs: Optional[bool] = None, *, cache: Union[CacheOptions, str, None] = None,
            progress: Optional[Progress] = None, cache_dir: Optional[str] = None, cache_max_gb: float = 20.0,
            mode: Optional[str] = None, step_cache: Union[StepCacheOptions, dict, None] = None
            ) -> Union[KilnModel, StepCachedModel]:
    """Compile a diffusion model (UNet or DiT) with Kiln's TorchDynamo backend, as `options` (a
    CompileOptions) and `cache` (a CacheOptions, or None: no cache) say.

    Returns a KilnModel: a module that behaves like `module` and compiles on its first call.
    `module` keeps owning its weights: the compiled code reads them on every call, so in-place
    edits, LoRA patches and new parameters of the same shape show up without a recompile. If the
    compile fails, the reason is logged and kept in `kiln.stats(...).fallback`, and the model
    runs eagerly from then on.

    Kiln compiles for inference: it sets `requires_grad=False` on the module's parameters, as
    ComfyUI's patched weights are, so that installing a patched weight does not fail a TorchDynamo
    guard and recompile. Run the compiled module under `torch.no_grad()` or `torch.inference_mode()`.

    Compiling the same module with the same options again returns the same KilnModel (and its
    compiled graphs); `progress` is then the new caller's.

    Kiln's cache stores each graph Inductor lowers, signed, and a later process loads it instead of
    compiling (CacheOptions: `dir`, "" for the default ~/.cache/kiln; `mode` "use", "refresh" to
    compile and replace, "off"). `kiln.stats(...).cache` says hit or miss, and why.

    Shorthands, the keyword forms: `options` may be a mode name ("fast", "balanced", "max"; also
    `mode=`) with `dynamic` and `cuda_graphs` (None, auto: whole calls replayed as CUDA graphs on a CUDA
    device, docs/cuda-graphs.md; True: per compiled graph; False: none); `cache_dir` turns the cache on there ("" for the
    default), with `cache` its mode ("use" unless given) and `cache_max_gb` its cap.

    `step_cache` (a StepCacheOptions or its mapping, `{}` for the defaults) puts the compiled model
    behind the step cache: `kiln.step_cached(kiln.compile(module, ...), step_cache)`, for a sampling
    loop that calls it as `model(x, timestep, ...)` (docs/step-cache.md); `kiln.stats` reads through it.

    Example:
        >>> unet = kiln.compile(unet, kiln.CompileOptions(mode="balanced"), cache=kiln.CacheOptions())
        >>> unet = kiln.compile(unet, "balanced", cache_dir="")  # the same, in short
        >>> with torch.no_grad():
        ...     noise_pred = unet(latents, t, encoder_hidden_states=context)
        >>> print(kiln.stats(unet).summary())
    """
    problem = unavailable_reason()
    if problem:
        raise KilnUnavailable(problem)
    if step_cache is not None and not isinstance(step_cache, (StepCacheOptions, dict)):
        raise OptionsError(f"step_cache={type(step_cache).__name__}: give a StepCacheOptions or a mapping of its "
                           "fields ({} for the defaults)")
    model = model_for(module, KilnPlan(compile=_compile_options(options, mode, dynamic, cuda_graphs),
                                       cache=_cache_options(cache, cache_dir, cache_max_gb)), progress=progress)
    return model if step_cache is None else step_cached(model, step_cache)


def _compile_options(options, mode, dynamic, cuda_graphs) -> CompileOptions:
    """CompileOptions from `options`, or from the keyword shorthands (a mode, dynamic, cuda_graphs)."""
    if isinstance(options, CompileOptions):
        if mode is not None or dynamic is not None or cuda_graphs is not None:
            raise OptionsError("give mode, dynamic and cuda_graphs inside the CompileOptions, not beside it")
        return options
    return CompileOptions(mode=mode or options, dynamic=dynamic, cuda_graphs=cuda_graphs)


def _cache_options(cache, cache_dir, max_gb) -> Optional[CacheOptions]:
    """The cache part: `cache` itself, or the keyword shorthands (cache_dir, a cache mode, cache_max_gb)."""
    if isinstance(cache, CacheOptions):
        if cache_dir is not None:
            raise OptionsError("give the cache directory inside the CacheOptions (dir=...), not as cache_dir")
        return cache
    if cache_dir is None:
        if cache not in (None, "use"):
            raise OptionsError(f"cache={cache!r} needs cache_dir (\"\" for the default, ~/.cache/kiln); without it "
                               "Kiln's cache is not used")
        return None
    return CacheOptions(dir=cache_dir, mode=cache or "use", max_gb=max_gb)


def stats(compiled: torch.nn.Module) -> KilnStats:
    """What Kiln did for a module returned by `kiln.compile`: graphs, recompiles and reasons, passes."""
    if isinstance(compiled, StepCachedModel):
        compiled = compiled.module
    if isinstance(compiled, KilnModel):
        return compiled.stats
    raise ValueError(f"{type(compiled).__name__} was not returned by kiln.compile")


def wait_lowered(compiled: torch.nn.Module, timeout: Optional[float] = None) -> list[str]:
    """With `background: true` (CompileOptions): wait until the lowering thread has lowered every region
    it can now (at most `timeout` seconds), and name the regions still waiting, whose blocks run eagerly
    until then: queued, under way, waiting for a measurement of their class by the model's next call,
    or not called yet ([]: none waits; always [] without background)."""
    if isinstance(compiled, StepCachedModel):
        compiled = compiled.module
    if not isinstance(compiled, KilnModel):
        raise ValueError(f"{type(compiled).__name__} was not returned by kiln.compile")
    return compiled.wait_lowered(timeout)
