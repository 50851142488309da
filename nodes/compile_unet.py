"""Kiln › Compile UNet: MODEL in, MODEL out with a compile step in its Kiln plan (UNet or DiT)."""
from __future__ import annotations

import logging

from . import plan_wrapper, shared
from .shared import DYNAMIC

log = logging.getLogger("kiln")


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
                "mode": shared.mode_widget(),
                "dynamic": (list(DYNAMIC), {"default": "auto", "tooltip":
                            "auto: any batch size from the first compile, other sizes dynamic once they change; true: all dynamic; false: specialise"}),
                "cuda_graphs": ("BOOLEAN", {"default": False, "tooltip": "capture CUDA graphs (CUDA only): by blocks, one graph replay per region instead of its kernel launches; off by default until checked in mode fast and through ComfyUI"}),
            },
            "optional": {
                "pin_shapes": ("STRING", {"default": "", "tooltip":
                               "image sizes to compile static kernels for, ahead, with the first compile: WxH in "
                               "pixels, ':B' for the batch the model sees (CFG included), e.g. 1024x1024, 832x1216:2. "
                               "Other sizes run on the dynamic graph with no compile. With pins the model compiles "
                               "whole (advanced 'compile_unit: blocks' keeps blocks, each pinned size compiled when "
                               "first run). Not in mode fast. At most shapes.max_variants sizes (8 by default); "
                               "sizes too large to compile ahead are refused, naming the bound."}),
                "advanced": ("STRING", {"multiline": True, "default": "", "tooltip":
                             "expert options as JSON or YAML, e.g. passes: {fuse_geglu: on}, "
                             "shapes: {specialize: buckets, max_variants: 4}, or cache: {dir: kiln-fast, max_gb: 50} "
                             "(what Kiln › Cache Graph sets; the dir lies under ComfyUI's user directory or the "
                             "server's KILN_CACHE_DIR)"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},  # the node shows each compile and shape variant as it happens
        }

    def compile(self, model, mode="balanced", dynamic="auto", cuda_graphs=False, pin_shapes="", advanced="",
                unique_id=None):
        from ..loaded import COMPILER_LOAD_ERROR, compiler

        if compiler is None:
            return shared.eager(model, COMPILER_LOAD_ERROR)
        # a bad option raises OptionsError (or ShapePolicyError) naming it: ComfyUI shows it on the node
        asked = compiler.build_options(mode, DYNAMIC[dynamic], cuda_graphs, advanced, pin_shapes=pin_shapes)
        unavailable = compiler.unavailable_reason() or plan_wrapper.missing_extension_points()
        if unavailable:
            return shared.eager(model, unavailable)
        parts = {"compile": asked.compile}
        if asked.cache is not None:  # confined as Kiln › Cache Graph's directory is
            parts["cache"] = shared.workflow_cache(asked.cache.dir, asked.cache.mode, asked.cache.max_gb)
        patched, plan, note = plan_wrapper.declare(model, show_compile_on=str(unique_id or ""), **parts)
        kiln_model = compiler.model_for(model.get_model_object("diffusion_model"), plan)
        if kiln_model.stats.fallback:  # this model already failed to compile under this plan
            return shared.eager(model, kiln_model.stats.fallback)
        notes = [note, compiler.kernel_note(str(getattr(model, "load_device", "cpu")))]
        report = (f"Kiln will run {type(kiln_model.original).__name__}'s plan on its first sampling step: {plan.describe()}."
                  f"{''.join(' ' + n for n in notes if n)}")
        if asked.compile.shapes.pin:
            report += f" Pinned shapes, compiled with it: {', '.join(map(str, asked.compile.shapes.pin))}."
        report += memory_note(model)
        problem = compiler.cache_problem(plan.cache) if plan.cache is not None else ""  # its own, or Cache Graph's
        if problem:
            report += f" Kiln's cache cannot be used: {problem}. It compiles without it."
        shared.show_report(report, problem, unique_id)
        return (patched, report)


def memory_note(model) -> str:
    """What ComfyUI's planning would load of the model now, where it would not load it whole (or leave too little
    for a CUDA-graph recording): said in the report and the log (nodes/partial_load.py). "" where it fits."""
    from . import partial_load

    verdict = partial_load.predicted(model)
    if verdict is None or not verdict.why:
        return ""
    note = f" Memory, as ComfyUI would load it now (its sampler's load decides): {verdict.why}."
    log.warning("Kiln:%s", note)
    return note


NODE_CLASS_MAPPINGS = {"KilnCompileUNet": KilnCompileUNet}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnCompileUNet": "Kiln › Compile UNet"}
