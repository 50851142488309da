"""Kiln › Cache Graph: MODEL in, MODEL out with Kiln's cache in its plan, so a restarted ComfyUI loads
its compiled graphs instead of compiling them again."""
from __future__ import annotations

import logging

from . import plan_wrapper, shared

log = logging.getLogger("kiln")


class KilnCacheGraph:
    DESCRIPTION = ("Stores what Kiln's compile produced on disk, signed, and loads it after a restart instead of "
                   "compiling again (hit or miss per graph, and why, in the log). Chain it with Compile UNet, in "
                   "either order. A LoRA or another fine-tune of the same architecture reuses the entry.")
    CATEGORY = "Kiln"
    FUNCTION = "cache"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("the model, with Kiln's cache in its plan", "the cache directory, its entries for this model")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "cache": shared.cache_mode_widget(),
            },
            "optional": {
                "cache_dir": ("STRING", {"default": "", "tooltip":
                              "empty: kiln-cache in ComfyUI's user directory (or the server's KILN_CACHE_DIR). A "
                              "folder under ComfyUI's user directory or KILN_CACHE_DIR; a relative name is a folder "
                              "in the user directory. Kiln creates it private (0700) and refuses one that other "
                              "users can write"}),
                "max_gb": ("FLOAT", {"default": 20.0, "min": 0.1, "max": 4096.0, "step": 0.5, "tooltip":
                           "size cap; the least recently used entries are evicted past it"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},  # the node shows each hit or miss as it happens
        }

    def cache(self, model, cache="use", cache_dir="", max_gb=20.0, unique_id=None):
        from ..loaded import COMPILER_LOAD_ERROR, compiler

        if compiler is None:
            report = f"Kiln: nothing cached: {COMPILER_LOAD_ERROR}"
            log.warning(report)
            return (model, report)
        unavailable = compiler.unavailable_reason() or plan_wrapper.missing_extension_points()
        if unavailable:
            report = f"Kiln: nothing cached: {unavailable}"
            log.warning(report)
            return (model, report)
        # a bad setting raises CacheOptionsError naming it: ComfyUI shows it on the node
        options = shared.workflow_cache(cache_dir, cache, float(max_gb))
        patched, plan, note = plan_wrapper.declare(model, show_cache_on=str(unique_id or ""), cache=options)
        name = type(model.get_model_object("diffusion_model")).__name__
        described = compiler.describe_cache(options, name)
        report, problem = described.text, described.problem
        if not problem:  # else the report says why it cannot be used, and that models compile without it
            report += _what_comes_next(plan)
        if note:
            report += f" {note}"
        shared.show_report(report, problem, unique_id)
        return (patched, report)


def _what_comes_next(plan) -> str:
    if plan.compile is None:
        return (" It is used once Kiln › Compile UNet is in the chain (before or after this node); hit or miss is "
                "decided per graph on the first sampling step, and this node and the log say which, and why.")
    if plan.cache_unused():
        return f" {plan.cache_unused()}."
    return " Hit or miss is decided per graph on the first sampling step; this node and the log say which, and why."


NODE_CLASS_MAPPINGS = {"KilnCacheGraph": KilnCacheGraph}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnCacheGraph": "Kiln › Cache Graph"}
