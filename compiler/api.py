"""The public API: `kiln.compile(module, ...)` and `kiln.stats(compiled)`. No ComfyUI here."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from . import compat
from .backend import KilnBackend
from .options import CompileOptions
from .shapes import mark_batch_and_resolution_dynamic
from .passes import Progress
from .stats import KilnStats

_STATS: "weakref.WeakKeyDictionary[torch.nn.Module, KilnStats]" = weakref.WeakKeyDictionary()
# Compiling the same module with the same options again (ComfyUI re-runs the node when a LoRA
# before it changes strength) returns the same compiled module, so TorchDynamo's compiled graphs
# are reused instead of recompiled. The memo lives in the module's own __dict__ (not a global
# table holding it alive): it goes away with the module.
_MEMO = "_kiln_compiled"


class KilnUnavailable(RuntimeError):
    """This environment cannot run Kiln's compiler (e.g. torch too old); the message says why."""


def compile(module: torch.nn.Module, mode: str = "balanced", dynamic: Optional[bool] = None,
            cuda_graphs: bool = False, *, options: Optional[CompileOptions] = None,
            progress: Optional[Progress] = None) -> torch.nn.Module:
    """Compile a diffusion model (UNet or DiT) with Kiln's TorchDynamo backend.

    Returns a module that behaves like `module` and compiles on its first call. `module` keeps
    owning its weights: the compiled code reads them on every call, so in-place edits, LoRA
    patches and new parameters of the same shape show up without a recompile.

    Kiln compiles for inference: it sets `requires_grad=False` on the module's parameters, as
    ComfyUI's patched weights are, so that installing a patched weight does not fail a TorchDynamo
    guard and recompile. Run the compiled module under `torch.no_grad()` or `torch.inference_mode()`.

    Compiling the same module with the same options again returns the same compiled module
    (and its compiled graphs); `progress` is then the new caller's.

    Example:
        >>> unet = kiln.compile(unet, mode="balanced")
        >>> with torch.no_grad():
        ...     noise_pred = unet(latents, t, encoder_hidden_states=context)
        >>> print(kiln.stats(unet).summary())
    """
    problem = compat.torch_version_problem()
    if problem:
        raise KilnUnavailable(problem)
    options = options or CompileOptions(mode=mode, dynamic=dynamic, cuda_graphs=cuda_graphs)
    key = repr(options.as_dict())
    memo = module.__dict__.setdefault(_MEMO, {})
    previous = memo.get(key)
    if previous is not None:
        previous[1].progress = progress
        return previous[0]
    module.requires_grad_(False)
    stats = KilnStats(options=options.as_dict())
    forward = getattr(type(module).forward, "__code__", None)
    backend = KilnBackend(options, stats, code=forward, progress=progress)
    compiled = torch.compile(module, backend=backend, dynamic=options.dynamic, fullgraph=options.fullgraph)
    if options.dynamic is None:  # "auto": batch and resolution are dynamic from the first compile, other sizes when they change
        compiled.register_forward_pre_hook(mark_batch_and_resolution_dynamic, with_kwargs=True)
    compiled.register_forward_pre_hook(backend.before_call, with_kwargs=True)
    compiled.register_forward_hook(backend.after_call, with_kwargs=True)
    _STATS[compiled] = stats
    memo[key] = (compiled, backend)
    return compiled


def stats(compiled: torch.nn.Module) -> KilnStats:
    """What Kiln did for a module returned by `kiln.compile`: graphs, recompiles and reasons, passes."""
    try:
        return _STATS[compiled]
    except (KeyError, TypeError):
        raise ValueError(f"{type(compiled).__name__} was not returned by kiln.compile") from None
