"""Kiln › Quantize Model, Kiln › Save Quantized Model and Kiln › Load Quantized Model."""
from __future__ import annotations

import logging
import os
import re

from . import plan_wrapper, quant_patcher, shared

log = logging.getLogger("kiln")

# Save Quantized Model writes SAVED_BY under SAVED_BY_KEY in each file's safetensors metadata; `overwrite`
# replaces only a file that has it, never a model of the user's (flux1-dev.safetensors)
SAVED_BY_KEY, SAVED_BY = "kiln_source", "Kiln › Save Quantized Model"
MAX_FILENAME_BYTES = 120  # UTF-8: with ".safetensors" and the temporary file's suffix, far below a 255-byte name


def _compiler():
    from ..loaded import COMPILER_LOAD_ERROR, compiler

    if compiler is None:  # quantizing cannot pass through: the user asked for other weights
        raise RuntimeError(f"Kiln cannot quantize: {COMPILER_LOAD_ERROR}")
    return compiler


class KilnQuantizeModel:
    DESCRIPTION = ("Quantizes the diffusion model's weights (int8 or fp8) into a new MODEL; the MODEL given is unchanged. "
                   "LoRA loaded before this node is baked in; LoRA after it still applies.")
    CATEGORY = "Kiln"
    FUNCTION = "quantize"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("the quantized model", "layers quantized and kept (and why), weight bytes, measured error")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "scheme": shared.scheme_widget(),
            },
            "optional": {
                "policy": ("STRING", {"multiline": True, "default": "", "tooltip":
                           "YAML: keep: [layer patterns kept in high precision], quantize: [patterns forced in], "
                           "min_params: 16384, convs: true, gpu_rule: auto (on a GPU, layers whose quantized GEMM would not be "
                           "faster there stay in high precision; none: quantize them anyway)"}),
                "calibration_steps": ("INT", {"default": 0, "min": 0, "max": 50, "tooltip":
                                      "denoising steps run on positive + latent to measure each layer's error; "
                                      "layers above error_threshold stay in high precision (0: off)"}),
                "error_threshold": ("FLOAT", {"default": 0.05, "min": 0.001, "max": 1.0, "step": 0.001}),
                "positive": ("CONDITIONING",),
                "latent": ("LATENT",),
            },
        }

    def quantize(self, model, scheme, policy="", calibration_steps=0, error_threshold=0.05, positive=None, latent=None):
        compiler = _compiler()
        options = compiler.QuantizeOptions(scheme, compiler.parse_policy(policy), calibration_steps, error_threshold)
        calibrate = None
        if calibration_steps:
            if positive is None or latent is None:
                raise ValueError("calibration_steps needs the positive conditioning and a latent to sample on")
            calibrate = quant_patcher.calibration_run(model, positive, latent, calibration_steps)
        quantized, report = quant_patcher.quantized_model(model, options, calibrate, plan_wrapper.progress_bar("quantize"))
        plan = (quantized.model_options.get(plan_wrapper.PLAN_KEY) or compiler.KilnPlan()).with_parts(quantize=options)
        quantized.model_options[plan_wrapper.PLAN_KEY] = plan
        if plan.compile is not None:  # compiled before this node: the compile wrapper runs the quantized model
            quantized, plan, _ = plan_wrapper.declare(quantized, compile=plan.compile)
        return (quantized, report.summary())


class KilnSaveQuantizedModel:
    DESCRIPTION = ("Saves a MODEL from Kiln › Quantize Model to models/diffusion_models as safetensors. fp8_e4m3 files load "
                   "in ComfyUI's own Load Diffusion Model node, int8_tensorwise files in a ComfyUI that has that format "
                   "(0.33.0 does), and every Kiln file in Kiln › Load Quantized Model.")
    CATEGORY = "Kiln"
    FUNCTION = "save"
    OUTPUT_NODE = True
    RETURN_TYPES = ()

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "filename": ("STRING", {"default": "kiln/quantized", "tooltip":
                                          "the file's name in models/diffusion_models (a folder below it too)"}),
                             "overwrite": ("BOOLEAN", {"default": False, "tooltip":
                                           "replace a file that this node saved; any other file is never replaced"})}}

    def save(self, model, filename, overwrite=False):
        import folder_paths

        _compiler()
        roots = folder_paths.get_folder_paths("diffusion_models")  # [models/unet (legacy name), models/diffusion_models, ...]
        root = next((r for r in roots if os.path.basename(os.path.normpath(r)) == "diffusion_models"), roots[0])
        path = target_path(root, filename)
        if os.path.lexists(path):
            if not saved_by_kiln(path):
                raise FileExistsError(f"filename {filename!r}: {path} exists and is not a file {SAVED_BY} wrote (its "
                                      f"safetensors metadata has no {SAVED_BY_KEY}: {SAVED_BY!r}), so Kiln never "
                                      f"replaces it, even with overwrite; choose another filename")
            if not overwrite:
                raise FileExistsError(f"filename {filename!r}: {path} exists; choose another filename or set overwrite")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:  # a file where a folder of the name should be
            raise ValueError(f"filename {filename!r}: cannot make the folder {os.path.dirname(path)} "
                             f"({exc.strerror})") from None
        readers = quant_patcher.save(model, path, metadata={SAVED_BY_KEY: SAVED_BY})
        log.info("Kiln: saved the quantized model to %s; the file loads in: %s", path, readers)
        return {"ui": {"text": [path, f"the file loads in: {readers}"]}}


def target_path(root: str, filename) -> str:
    """The .safetensors file in `root` (or a folder below it) that Save Quantized Model's `filename` names.
    A name that is not plain text, too long, hidden (a part starting with '.'), has an empty part, or
    leaves `root`: ValueError naming `filename`."""
    if not isinstance(filename, str):
        raise ValueError(f"filename must be text, got {type(filename).__name__}")
    if not filename.strip():
        raise ValueError("filename is empty; give a name such as 'kiln/quantized'")
    if not filename.isprintable():  # NUL, newlines, other control and invisible characters
        bad = next(c for c in filename if not c.isprintable())
        raise ValueError(f"filename {filename[:MAX_FILENAME_BYTES]!r} holds the character {bad!r}; use printable "
                         f"characters only")
    size = len(filename.encode())
    if size > MAX_FILENAME_BYTES:
        raise ValueError(f"filename is {size:,} bytes long (UTF-8); the limit is {MAX_FILENAME_BYTES}")
    name = filename if filename.endswith(".safetensors") else filename + ".safetensors"
    path = os.path.abspath(os.path.join(root, name))
    if not path.startswith(os.path.abspath(root) + os.sep):
        raise ValueError(f"filename {filename!r} leaves the diffusion_models folder")
    for part in re.split(r"[/\\]", filename):
        if not part.strip():
            raise ValueError(f"filename {filename!r} has an empty name before, between or after a '/'; give a "
                             f"name such as 'kiln/quantized'")
        if part.startswith("."):
            raise ValueError(f"filename {filename!r}: {part!r} starts with '.', which makes a hidden file or folder "
                             f"(or is '..'); give a name such as 'kiln/quantized'")
    return path


def saved_by_kiln(path: str) -> bool:
    """Whether `path` is a plain file (not a link) whose safetensors metadata says Save Quantized Model
    wrote it. safetensors reads only the header, bounded (and checked) by safetensors itself."""
    from safetensors import SafetensorError, safe_open

    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
    except (OSError, SafetensorError):  # not a safetensors file, or one safetensors refuses
        return False
    return metadata.get(SAVED_BY_KEY) == SAVED_BY


class KilnLoadQuantizedModel:
    DESCRIPTION = ("Loads a quantized diffusion model saved by Kiln (int8 or fp8), or one of ComfyUI's float8_e4m3fn or "
                   "int8_tensorwise files, into Kiln's quantized layers, without the original weights. A file in formats "
                   "only ComfyUI reads (nvfp4, float8_e5m2, ...) is loaded by ComfyUI's own loader, and the report says so.")
    CATEGORY = "Kiln"
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        return {"required": {"unet_name": (folder_paths.get_filename_list("diffusion_models"),)}}

    def load(self, unet_name):
        import folder_paths

        _compiler()
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        model, report = quant_patcher.load_file(path, unet_name)
        log.info(report)
        return (model, report)


NODE_CLASS_MAPPINGS = {"KilnQuantizeModel": KilnQuantizeModel, "KilnSaveQuantizedModel": KilnSaveQuantizedModel,
                       "KilnLoadQuantizedModel": KilnLoadQuantizedModel}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnQuantizeModel": "Kiln › Quantize Model",
                              "KilnSaveQuantizedModel": "Kiln › Save Quantized Model",
                              "KilnLoadQuantizedModel": "Kiln › Load Quantized Model"}
