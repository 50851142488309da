"""ComfyUI's `transformer_options` as a whole-call CUDA graph recording must read it (compiler/graphs;
the compiler knows no ComfyUI key: compiler/host_inputs.py). nodes/block_inputs.py answers the
compiler's three questions with these:

- `fingerprint`: what a recording bakes in of a transformer_options dict beyond its tensors (which the
  compiler keys itself): its keys, `cond_or_uncond` (which half of a guidance batch is which), every
  patch, replacement and diffusion-model wrapper by name and id, and its plain top-level values.
  Nothing else in it is read by ComfyUI's model code (the keys a block writes, POSITION_KEYS and
  SCRATCH_KEYS, are written during the call, not read from the caller's dict; `uuids` are read only by
  patches, and a patch that reads them is not graph-safe).
- `unsafe_patches`: the patches, replacements and diffusion-model wrappers not in GRAPH_SAFE: a
  replay runs none of their Python (IPAdapter's `.item()`, reference-only's and SAG's state kept
  between calls). A patch is graph-safe when its Python depends only on the shapes (which the key
  holds) and it never reads a tensor's value on the host.
- `weights_note`: why the weights cannot be read at fixed addresses: ComfyUI's low-VRAM loading casts
  or patches a layer's weights during the call (`comfy_cast_weights`, `weight_function`,
  `bias_function` on the layer).
"""
from __future__ import annotations

from typing import Any, Hashable, Iterator, Optional

import torch

# the keys that make a dict ComfyUI's transformer_options (the sampler sets the first two on every call)
OPTIONS_KEYS = ("cond_or_uncond", "sigmas", "patches", "patches_replace", "wrappers")
# transformer_options["wrappers"][DIFFUSION_MODEL_WRAPPERS]: the wrappers that run inside the model call
# (the other wrapper types, Kiln's own APPLY_MODEL wrapper among them, run outside the call recorded)
DIFFUSION_MODEL_WRAPPERS = "diffusion_model"
# patches whose Python reads only shapes and never a tensor's value on the host, by "module:qualname"
GRAPH_SAFE = frozenset({
    "comfy_extras.nodes_freelunch:FreeU.patch.<locals>.output_block_patch",     # FreeU's Fourier filter
    "comfy_extras.nodes_freelunch:FreeU_V2.patch.<locals>.output_block_patch",
})
_PLAIN = (type(None), bool, int, float, str)


def is_options(value: Any) -> bool:
    return isinstance(value, dict) and any(key in value for key in OPTIONS_KEYS)


def fingerprint(value: Any) -> Optional[Hashable]:
    if not is_options(value):
        return None
    plain = tuple((key, item) for key, item in value.items() if isinstance(key, str) and isinstance(item, _PLAIN))
    return (tuple(sorted(map(str, value))), tuple(value.get("cond_or_uncond") or ()),
            tuple((where, name, id(fn)) for where, name, fn in _installed(value)), plain)


def unsafe_patches(value: Any) -> tuple[str, ...]:
    if not is_options(value):
        return ()
    return tuple(f"{where} {name}" for where, name, _ in _installed(value) if name not in GRAPH_SAFE)


def weights_note(module: torch.nn.Module) -> str:
    for name, layer in module.named_modules():
        state = layer.__dict__
        if state.get("comfy_cast_weights") or state.get("weight_function") or state.get("bias_function"):
            return f"ComfyUI's low-VRAM loading casts or patches {name or 'the model'}'s weights during the call"
    return ""


def _installed(value: dict) -> Iterator[tuple[str, str, Any]]:
    """(where, 'module:qualname', the callable) for every patch, replacement and diffusion-model wrapper."""
    for kind in ("patches", "patches_replace"):
        for where, installed in (value.get(kind) or {}).items():
            for fn in _callables(installed):
                yield f"{kind}.{where}", _name(fn), fn
    wrappers = (value.get("wrappers") or {}).get(DIFFUSION_MODEL_WRAPPERS) or {}
    for fn in _callables(wrappers):
        yield f"wrappers.{DIFFUSION_MODEL_WRAPPERS}", _name(fn), fn


def _callables(value: Any, depth: int = 3) -> Iterator[Any]:
    if isinstance(value, dict) and depth:
        for item in value.values():
            yield from _callables(item, depth - 1)
    elif isinstance(value, (list, tuple)) and depth:
        for item in value:
            yield from _callables(item, depth - 1)
    elif callable(value):
        yield value


def _name(fn: Any) -> str:
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(fn).__name__)}"
