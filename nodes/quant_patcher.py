"""How a quantized model becomes a ComfyUI MODEL, and back to a file.

`quantized_model(model, options)`: a new MODEL (ModelPatcher) around a copy of the BaseModel whose
diffusion model is quantized; the MODEL given is never changed, so other branches of the workflow
still get full precision. The weights quantized are this MODEL's own: ComfyUI loads it first with
its own patches applied (a LoRA loaded before the node is baked in; another branch's LoRA, which
ComfyUI may have left applied to the shared module, is taken off first).

LoRA and other weight patches added after the node go through ComfyUI's own path for quantized
weights: the ModelPatcher finds `convert_weight`/`set_weight` on Kiln's quantized layers, patches
the dequantized weight and stores it quantized again on the layer's own scales.

`load_file(path, name)`: Kiln › Load Quantized Model. A file whose every layer Kiln reads loads
into Kiln's quantized layers: `load_ops()` are the custom operations ComfyUI's diffusion-model
loader builds the model with, so quantized layers are never allocated in high precision. A file
with a layer in a format only ComfyUI reads (nvfp4, float8_e5m2, ...) goes to ComfyUI's own loader
when the running ComfyUI reads every format in it (compiler/quantize/file_format.py reader_for
decides; comfy.quant_ops.QUANT_ALGOS says what this ComfyUI reads).
"""
from __future__ import annotations

import collections
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


def save(model, path: str, metadata: dict) -> str:
    """Write `model`'s quantized diffusion model (with any patches applied after quantization baked
    in, as ComfyUI's own savers do) to a safetensors file, atomically: a failed save leaves an
    existing file as it was (compiler/quantize/file_format.py write_atomically). Returns what loads
    the file (its schemes' readers)."""
    import comfy.model_management

    from ..compiler import quantized_file_readers, save_quantized

    comfy.model_management.load_models_gpu([model], force_patch_weights=True)
    save_quantized(model.model.diffusion_model, path, metadata=metadata)
    return quantized_file_readers(model.model.diffusion_model)


def comfyui_quant_formats() -> frozenset:
    """The quantized formats the running ComfyUI's own loader reads: the keys of comfy.quant_ops.QUANT_ALGOS
    (none in a ComfyUI older than its per-layer quantized formats, which has no comfy.quant_ops)."""
    try:
        from comfy.quant_ops import QUANT_ALGOS
    except ImportError:
        return frozenset()
    return frozenset(QUANT_ALGOS)


def load_file(path: str, name: str):
    """(MODEL, report) for Kiln › Load Quantized Model's file `path` (`name` in ComfyUI's list): Kiln's
    quantized layers, or ComfyUI's own loader for a file in formats only ComfyUI reads (see the module
    docstring). A damaged file, or one that neither Kiln nor this ComfyUI reads: QuantizeError naming
    the file and a layer."""
    import comfy.utils

    from ..compiler import READER_COMFYUI, QuantizeError, marked_formats, reader_for
    from .plan_wrapper import comfyui_version

    state_dict, metadata = comfy.utils.load_torch_file(path, safe_load=True, return_metadata=True)
    # ComfyUI's older "scaled_fp8" files into its current per-layer format, as its own loader does
    state_dict, metadata = comfy.utils.convert_old_quants(state_dict, "", metadata=metadata)
    try:  # a damaged layer (checked as ComfyUI's loader reads it) is said with the file's name
        formats = marked_formats(state_dict)
        if reader_for(formats, comfyui_quant_formats(), comfyui_version()) == READER_COMFYUI:
            del state_dict  # ComfyUI's loader reads the file again: do not hold two copies
            return _loaded_by_comfyui(path, name, formats)
        return _loaded_by_kiln(path, name, state_dict, metadata)
    except QuantizeError as error:
        raise QuantizeError(f"{path}: {error}") from error


def _loaded_by_kiln(path: str, name: str, state_dict: dict, metadata):
    import comfy.sd

    model = comfy.sd.load_diffusion_model_state_dict(state_dict, {"custom_operations": load_ops()}, metadata=metadata)
    if model is None:
        raise ValueError(f"ComfyUI could not detect the model type of {path}")
    swapped = swap_in_quantized(model.model.diffusion_model)
    if not swapped:
        raise ValueError(f"{path} has no quantized layers; load it with ComfyUI's Load Diffusion Model node")
    return model, f"Kiln: loaded {name} with {swapped} quantized layers."


def _loaded_by_comfyui(path: str, name: str, formats: dict):
    """ComfyUI's own Load Diffusion Model path (comfy.sd.load_diffusion_model) for a file Kiln does not read."""
    import comfy.sd

    from .plan_wrapper import comfyui_version

    model = comfy.sd.load_diffusion_model(path)
    by_format = collections.Counter(str(marked) for marked in formats.values())
    kiln_cannot = sorted({str(marked) for marked in formats.values() if not marked.kiln_reads})
    counts = ", ".join(f"{count} {fmt}" for fmt, count in sorted(by_format.items()))
    return model, (f"Kiln: {name} has layers in {', '.join(kiln_cannot)}, which Kiln's quantized layers do not read, "
                   f"so ComfyUI {comfyui_version()}'s own loader loaded it (quantized layers: {counts}; ComfyUI's "
                   f"quantized weights, not Kiln's). Kiln › Compile UNet still applies to this model.")


def load_ops():
    """ComfyUI custom operations whose Linear and Conv2d read a quantized layer of a Kiln file (or a
    ComfyUI one in a format Kiln reads) without allocating its high-precision weight; `swap_in_quantized` then
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

