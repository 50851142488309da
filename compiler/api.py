"""The public API: `kiln.compile(module, ...)` and `kiln.stats(compiled)`. No ComfyUI here."""
from __future__ import annotations

from typing import Optional

import torch

from .cache import CacheOptions
from .model import KilnModel, KilnUnavailable, model_for, unavailable_reason
from .options import CompileOptions, OptionsError
from .passes import Progress
from .plan import KilnPlan
from .stats import KilnStats


def compile(module: torch.nn.Module, mode: str = "balanced", dynamic: Optional[bool] = None,
            cuda_graphs: bool = False, *, options: Optional[CompileOptions] = None,
            progress: Optional[Progress] = None, cache_dir: Optional[str] = None, cache: str = "use",
            cache_max_gb: float = 20.0) -> KilnModel:
    """Compile a diffusion model (UNet or DiT) with Kiln's TorchDynamo backend.

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

    `cache_dir` turns on Kiln's cache there ("" for the default, ~/.cache/kiln; None, the default: no
    cache): each graph Inductor
    lowers is stored, signed, and a later process loads it instead of compiling (`cache`: "use",
    "refresh" to compile and replace, "off"). `kiln.stats(...).cache` says hit or miss, and why.

    Example:
        >>> unet = kiln.compile(unet, mode="balanced", cache_dir="")
        >>> with torch.no_grad():
        ...     noise_pred = unet(latents, t, encoder_hidden_states=context)
        >>> print(kiln.stats(unet).summary())
    """
    problem = unavailable_reason()
    if problem:
        raise KilnUnavailable(problem)
    options = options or CompileOptions(mode=mode, dynamic=dynamic, cuda_graphs=cuda_graphs)
    if cache_dir is None and cache != "use":
        raise OptionsError(f"cache={cache!r} needs cache_dir (\"\" for the default, ~/.cache/kiln); without it "
                           "Kiln's cache is not used")
    cache_options = CacheOptions(dir=cache_dir, mode=cache, max_gb=cache_max_gb) if cache_dir is not None else None
    return model_for(module, KilnPlan(compile=options, cache=cache_options), progress=progress)


def stats(compiled: torch.nn.Module) -> KilnStats:
    """What Kiln did for a module returned by `kiln.compile`: graphs, recompiles and reasons, passes."""
    if isinstance(compiled, KilnModel):
        return compiled.stats
    raise ValueError(f"{type(compiled).__name__} was not returned by kiln.compile")
