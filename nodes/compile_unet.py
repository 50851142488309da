"""Kiln › Compile UNet: MODEL in, compiled MODEL out (UNet or DiT: whatever the diffusion model is)."""
from __future__ import annotations

import logging

from . import comfy_wrapper

log = logging.getLogger("kiln")

MODES = ("fast", "balanced", "max")
DYNAMIC = {"auto": None, "true": True, "false": False}


class KilnCompileUNet:
    DESCRIPTION = ("Compiles the diffusion model (SD1.5/SD2/SDXL UNet, SD3/Flux/PixArt DiT) with Kiln on the first "
                   "sampling step. LoRA and other patches applied after this node still take effect.")
    CATEGORY = "Kiln"
    FUNCTION = "compile"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("the model, compiled on its first sampling step", "what Kiln will do (or why it runs eagerly)")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "mode": (list(MODES), {"default": "balanced", "tooltip":
                         "fast: quick compile, no Inductor; balanced: default; max: longest compile, most speed"}),
                "dynamic": (list(DYNAMIC), {"default": "auto", "tooltip":
                            "auto: any batch size from the first compile, other sizes dynamic once they change; true: all dynamic; false: specialise"}),
                "cuda_graphs": ("BOOLEAN", {"default": False, "tooltip": "capture CUDA graphs (CUDA only)"}),
            },
            "optional": {
                "pin_shapes": ("STRING", {"default": "", "tooltip":
                               "image sizes to compile static kernels for, ahead, with the first compile: WxH in "
                               "pixels, ':B' for the batch the model sees (CFG included), e.g. 1024x1024, 832x1216:2. "
                               "Other sizes run on the dynamic graph with no compile. Not in mode fast."}),
                "advanced": ("STRING", {"multiline": True, "default": "", "tooltip":
                             "expert options as JSON or YAML, e.g. passes: {fuse_geglu: on} or "
                             "shapes: {specialize: buckets, max_variants: 4}"}),
            },
        }

    def compile(self, model, mode="balanced", dynamic="auto", cuda_graphs=False, pin_shapes="", advanced=""):
        from .. import IMPORT_ERROR

        if IMPORT_ERROR:
            return self._eager(model, f"Kiln's compiler could not load ({IMPORT_ERROR})")
        from ..compiler import KilnUnavailable, build_options, compat, compile as kiln_compile, stats

        options = build_options(mode, DYNAMIC[dynamic], cuda_graphs, advanced)  # OptionsError names the bad key
        if pin_shapes.strip():  # a bad size raises ShapePolicyError naming it
            options = options.replace(shapes=options.shapes.with_pins(pin_shapes))
        diffusion_model = model.get_model_object("diffusion_model")
        try:
            compiled = kiln_compile(diffusion_model, options=options, progress=comfy_wrapper.progress_bar())
        except KilnUnavailable as exc:
            return self._eager(model, str(exc))
        info = stats(compiled)
        if info.fallback:  # this module already failed to compile with these options
            return self._eager(model, info.fallback)
        patched = model.clone()
        wrapper = comfy_wrapper.make_apply_model_wrapper(compiled, info, compat)
        notes = [comfy_wrapper.install(patched, wrapper), kernel_note(str(getattr(model, "load_device", "cpu")))]
        report = (f"Kiln will compile {type(diffusion_model).__name__} on the first sampling step "
                  f"({options.mode}, dynamic={dynamic}, cuda_graphs={cuda_graphs}).{''.join(' ' + n for n in notes if n)}")
        if options.shapes.pin:
            report += f" Pinned shapes, compiled with it: {', '.join(map(str, options.shapes.pin))}."
        log.info(report)
        return (patched, report)

    @staticmethod
    def _eager(model, reason: str):
        report = f"Kiln: running eagerly, nothing compiled: {reason}"
        log.warning(report)
        return (model, report)


def kernel_note(device: str) -> str:
    """What the user should know about Kiln's kernels on this device ("" if nothing)."""
    from ..kernels import triton_available

    if device.startswith("cuda") and not triton_available():
        return "Triton is not installed: Kiln's kernels run their torch references (slower); install triton for full speed."
    return ""


NODE_CLASS_MAPPINGS = {"KilnCompileUNet": KilnCompileUNet}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnCompileUNet": "Kiln › Compile UNet"}
