"""How a quantized model becomes a ComfyUI MODEL, and back to a file.

`quantized_model(model, options)`: a new MODEL (ModelPatcher) around a copy of the BaseModel whose
diffusion model is quantized; the MODEL given is never changed, so other branches of the workflow
still get full precision. The weights quantized are this MODEL's own: ComfyUI loads it first with
its own patches applied (a LoRA loaded before the node is baked in; another branch's LoRA, which
ComfyUI may have left applied to the shared module, is taken off first).

LoRA and other weight patches added after the node go through ComfyUI's own path for quantized
weights: the ModelPatcher finds `convert_weight`/`set_weight` on Kiln's quantized layers, patches
the dequantized weight and stores it quantized again on the layer's own scales.

`load_ops()`: the custom operations ComfyUI's diffusion-model loader builds a model with when Kiln
loads a quantized file: quantized layers are never allocated in high precision.
"""
from __future__ import annotations

import copy
import logging

log = logging.getLogger("kiln")

DIFFUSION_PREFIX = "diffusion_model."
# Attributes ComfyUI's ModelPatcher keeps on the BaseModel about its loaded state: a new model starts without them.
_LOAD_STATE = ("model_loaded_weight_memory", "lowvram_patch_counter", "model_lowvram", "current_weight_patches_uuid",
               "model_offload_buffer_memory")
# What a ModelPatcher carries from the nodes before it, other than weight patches (baked into the weights).
_CARRIED = ("model_options", "object_patches", "weight_wrapper_patches", "wrappers", "callbacks", "attachments",
            "additional_models", "injections", "force_cast_weights")


def quantized_model(model, options, calibrate=None, progress=None):
    """(new MODEL, QuantReport) for `model` quantized under `options` (a QuantizeOptions)."""
    import comfy.model_management

    from ..compiler import quantize

    comfy.model_management.load_models_gpu([model], force_patch_weights=True)
    base = model.model
    patched = {k[len(DIFFUSION_PREFIX):] for k in model.patches if k.startswith(DIFFUSION_PREFIX)}
    quantized = quantize(base.diffusion_model, options, calibrate=calibrate, device=model.offload_device,
                         share_kept=True, copy_kept=patched, progress=progress)
    report = quantized.kiln_quant_report
    if patched:
        report.notes.append(f"{len(patched)} weight patches made before this node (LoRA, merges) are baked in")
    return rebased(model, with_diffusion_model(base, quantized, model.offload_device)), report


def with_diffusion_model(base, diffusion_model, device):
    """A copy of ComfyUI's BaseModel `base` with another diffusion model (nothing else of weight is copied)."""
    memo = {id(base.diffusion_model): diffusion_model}
    config = getattr(base, "model_config", None)
    if config is not None:  # shared: configuration, and it answers None for any attribute, which deepcopy trips on
        memo[id(config)] = config
    new_base = copy.deepcopy(base, memo)
    for name in _LOAD_STATE:
        new_base.__dict__.pop(name, None)
    new_base.device = device
    return new_base


def rebased(model, new_base):
    """A ModelPatcher for `new_base` carrying `model`'s options, object patches, wrappers and callbacks,
    copied by ComfyUI's own `clone()` (the clone itself, bound to the old BaseModel, is dropped)."""
    import comfy.model_patcher

    patcher = comfy.model_patcher.ModelPatcher(new_base, load_device=model.load_device,
                                               offload_device=model.offload_device)
    copies = model.clone()
    for name in _CARRIED:
        if hasattr(copies, name):
            setattr(patcher, name, getattr(copies, name))
    return patcher


def calibration_run(model, positive, latent, steps: int):
    """A function that samples `steps` denoising steps of `model` (Kiln's compile wrapper removed, so
    calibration measures the eager layers) on the user's conditioning and latent."""
    def run():
        import comfy.sample
        from comfy.patcher_extension import WrappersMP

        from .plan_wrapper import WRAPPER_KEY

        eager = model.clone()
        eager.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
        samples = latent["samples"]
        noise = comfy.sample.prepare_noise(samples, 0)
        comfy.sample.sample(eager, noise, steps, 1.0, "euler", "normal", positive, positive, samples,
                            disable_pbar=True, seed=0)
    return run


def save(model, path: str, metadata: dict) -> None:
    """Write `model`'s quantized diffusion model (with any patches applied after quantization baked
    in, as ComfyUI's own savers do) to a safetensors file, atomically: a failed save leaves an
    existing file as it was (compiler/quantize/file_format.py write_atomically)."""
    import comfy.model_management

    from ..compiler import save_quantized

    comfy.model_management.load_models_gpu([model], force_patch_weights=True)
    save_quantized(model.model.diffusion_model, path, metadata=metadata)


def load_ops():
    """ComfyUI custom operations whose Linear and Conv2d read a quantized layer of a Kiln (or a
    ComfyUI fp8) file without allocating its high-precision weight; `swap_in_quantized` then
    replaces them by Kiln's quantized layers."""
    import comfy.ops
    import torch

    from ..compiler import pop_quantized_layer

    def loading(base):
        class Layer(base):
            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                stored = pop_quantized_layer(state_dict, prefix)
                if stored is None:
                    return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                         unexpected_keys, error_msgs)
                self.kiln_stored = stored
                self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # the float weight is never filled
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)
                if f"{prefix}weight" in missing_keys:
                    missing_keys.remove(f"{prefix}weight")
        Layer.__name__ = base.__name__
        return Layer

    class KilnLoadOps(comfy.ops.manual_cast):
        Linear = loading(comfy.ops.manual_cast.Linear)
        Conv2d = loading(comfy.ops.manual_cast.Conv2d)

    return KilnLoadOps


def swap_in_quantized(diffusion_model) -> int:
    """Replace each layer `load_ops` read as quantized by Kiln's quantized layer; returns how many."""
    from ..compiler import stored_to_layer

    swapped = 0
    for name, layer in list(diffusion_model.named_modules()):
        stored = layer.__dict__.pop("kiln_stored", None)
        if stored is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = diffusion_model.get_submodule(parent_name) if parent_name else diffusion_model
        setattr(parent, child, stored_to_layer(stored, layer))
        swapped += 1
    return swapped

