"""ComfyUI's partial load ("lowvram") as Kiln's compiler must see it: the bytes behind its memory verdict
(compiler/memory_budget.py; the compiler knows no ComfyUI attribute).

When a model does not fit in what ComfyUI plans to leave free (comfy/model_management.py `load_models_gpu`:
the device's free memory less `minimum_inference_memory()`, which holds `--reserve-vram`), its
ModelPatcher loads the layers that fit and leaves the others on the offload device, marked to be cast
in during each call (`ModelPatcher.load` sets the layer's `comfy_cast_weights`, keeping the earlier
value in `prev_comfy_cast_weights`; a loaded layer has `comfy_patched_weights`). The BaseModel keeps the
load's totals: `model_lowvram`, `model_loaded_weight_memory`.

- `streamed(layer)`: the layer is one ComfyUI casts in per call (STREAMED_MARK set, LOADED_MARK not).
- `verdict_for(base_model, kiln_model)`: the load's bytes (model, resident, free and cap within ComfyUI's
  reserve, what it keeps for a call) and each Kiln block's streamed bytes, to `memory_verdict`; made again
  only when the load changed (LOAD_KEYS).
- `predicted(model_patcher)`: at the node, before any load, what ComfyUI's planning would load of the
  model now, as a verdict without blocks (the sampler's load decides; the node's report says so).
"""
from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger("kiln")

STREAMED_MARK = "prev_comfy_cast_weights"   # set by ComfyUI's partial load on a layer it casts in per call
LOADED_MARK = "comfy_patched_weights"        # set on a layer loaded (and patched) on the device
LOAD_KEYS = ("model_lowvram", "model_loaded_weight_memory", "lowvram_patch_counter")  # what a new load changes

_last: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # KilnModel -> (load key, verdict)


def streamed(layer: torch.nn.Module) -> bool:
    state = layer.__dict__
    return STREAMED_MARK in state and not state.get(LOADED_MARK)


def _own_bytes(layer: torch.nn.Module) -> int:
    return sum(t.nbytes for t in (*layer.parameters(recurse=False), *layer.buffers(recurse=False)))


def block_weights(kiln_model) -> list:
    """A BlockWeights for each of the Kiln model's blocks: its weights, and those ComfyUI streams."""
    from ..loaded import compiler

    found = []
    for path, block in kiln_model.blocks():
        total = cast_in = 0
        for layer in block.modules():
            size = _own_bytes(layer)
            total += size
            cast_in += size if streamed(layer) else 0
        found.append(compiler.BlockWeights(path=path, nbytes=total, streamed_bytes=cast_in))
    return found


def device_memory(device, model_bytes: int, resident_bytes: int, free_bytes=None):
    """The DeviceMemory ComfyUI's own accounting gives for `device`: free (now, or `free_bytes` as ComfyUI
    counts it) and cap within its reserve."""
    import comfy.model_management as mm

    from ..loaded import compiler

    reserve = mm.extra_reserved_memory()
    free = (mm.get_free_memory(device) if free_bytes is None else free_bytes) - reserve
    cap = mm.get_total_memory(device) - reserve
    return compiler.DeviceMemory(model_bytes=int(model_bytes), resident_bytes=int(min(resident_bytes, model_bytes)),
                                 free_bytes=int(max(0, free)), cap_bytes=int(max(0, cap)),
                                 inference_bytes=int(max(0, mm.minimum_inference_memory() - reserve)))


def verdict_for(base_model, kiln_model):
    """The memory verdict for the Kiln model as ComfyUI loaded `base_model` for this call (kept per load)."""
    import comfy.model_management as mm

    from ..loaded import compiler

    key = tuple(getattr(base_model, name, None) for name in LOAD_KEYS)
    last = _last.get(kiln_model)
    if last is not None and last[0] == key:
        return last[1]
    model_bytes = mm.module_size(base_model)
    partly = bool(getattr(base_model, "model_lowvram", False))
    resident = getattr(base_model, "model_loaded_weight_memory", model_bytes) if partly else model_bytes
    device = getattr(base_model, "device", None) or next(base_model.parameters()).device
    if not partly and torch.device(device).type == "cpu":  # ComfyUI loads whole on a CPU; no CUDA graph to size
        verdict = compiler.MemoryVerdict(fits=True)
        _last[kiln_model] = (key, verdict)
        return verdict
    memory = device_memory(device, model_bytes, resident)
    verdict = compiler.memory_verdict(memory, block_weights(kiln_model) if partly else ())
    _last[kiln_model] = (key, verdict)
    return verdict


def predicted(model_patcher):
    """At the node: what ComfyUI would load of the model now (load_models_gpu's plan for a call that needs
    `minimum_inference_memory()`), as a verdict without blocks; None where ComfyUI never loads partly (a CPU
    device, or its high-VRAM and no-offload modes)."""
    import comfy.model_management as mm

    device = model_patcher.load_device
    if mm.is_device_cpu(device) or mm.vram_state not in (mm.VRAMState.LOW_VRAM, mm.VRAMState.NORMAL_VRAM):
        return None
    from ..loaded import compiler

    model_bytes = model_patcher.model_size()
    free = mm.get_free_memory(device) + model_patcher.loaded_size()
    resident = model_bytes if free - mm.minimum_inference_memory() >= model_bytes \
        else max(0, free - mm.minimum_inference_memory())
    memory = device_memory(device, model_bytes, resident, free_bytes=free - resident)
    return compiler.memory_verdict(memory, ())
