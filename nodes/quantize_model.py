"""Kiln › Quantize Model, Kiln › Save Quantized Model and Kiln › Load Quantized Model."""
from __future__ import annotations

import logging
import os

from . import plan_wrapper, quant_patcher, shared

log = logging.getLogger("kiln")


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
                           "min_params: 16384, convs: true"}),
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
        return {"required": {"model": ("MODEL",), "filename": ("STRING", {"default": "kiln/quantized"}),
                             "overwrite": ("BOOLEAN", {"default": False})}}

    def save(self, model, filename, overwrite=False):
        import folder_paths

        _compiler()
        roots = folder_paths.get_folder_paths("diffusion_models")  # [models/unet (legacy name), models/diffusion_models, ...]
        root = next((r for r in roots if os.path.basename(os.path.normpath(r)) == "diffusion_models"), roots[0])
        path = os.path.abspath(os.path.join(root, filename if filename.endswith(".safetensors") else filename + ".safetensors"))
        if not path.startswith(os.path.abspath(root) + os.sep):
            raise ValueError(f"filename {filename!r} leaves the diffusion_models folder")
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"{path} exists; choose another filename or set overwrite")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        readers = quant_patcher.save(model, path, metadata={"kiln_source": "Kiln › Save Quantized Model"})
        log.info("Kiln: saved the quantized model to %s; the file loads in: %s", path, readers)
        return {"ui": {"text": [path, f"the file loads in: {readers}"]}}


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
