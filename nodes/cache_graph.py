"""Kiln › Cache Graph: MODEL in, MODEL out with Kiln's cache in its plan, so a restarted ComfyUI loads
its compiled graphs instead of compiling them again."""
from __future__ import annotations

import logging
import os

from . import plan_wrapper

log = logging.getLogger("kiln")

MODES = ("use", "refresh", "off")


def default_dir() -> str:
    """KILN_CACHE_DIR if the server's owner set it, else kiln-cache in ComfyUI's user directory
    (beside its settings, outside every node pack)."""
    import folder_paths

    from ..compiler import server_cache_dir

    return server_cache_dir() or os.path.join(folder_paths.get_user_directory(), "kiln-cache")


def workflow_cache(cache_dir: str, mode: str, max_gb: float):
    """The cache a workflow asks for. A workflow is untrusted, so its directory is confined to
    ComfyUI's user directory and KILN_CACHE_DIR (a relative name is a folder in the user directory);
    one outside them is not used, and the model compiles without the cache, saying why."""
    import folder_paths

    from ..compiler import CacheOptions, server_cache_dir

    user = folder_paths.get_user_directory()
    named = cache_dir  # not text: CacheOptions refuses it, naming the setting
    if isinstance(cache_dir, str):  # a relative name joins the user directory; an absolute one stays as it is
        named = os.path.join(user, os.path.expanduser(cache_dir.strip()) or default_dir())
    within = (user,) + ((server_cache_dir(),) if server_cache_dir() else ())
    return CacheOptions(dir=named, mode=mode, max_gb=max_gb, within=within)


def show_report(report: str, problem: str, node_id) -> None:
    """Log the cache's report; a cache that cannot be used is a warning, shown on the node at once."""
    if problem:
        log.warning(report)
        plan_wrapper.show_text(str(node_id or ""), report)
    else:
        log.info(report)


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
                "cache": (list(MODES), {"default": "use", "tooltip":
                          "use: load a matching entry, else compile and store; refresh: compile and replace the "
                          "entry; off: neither read nor write"}),
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
        from . import COMPILER_LOAD_ERROR, compiler

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
        options = workflow_cache(cache_dir, cache, float(max_gb))
        patched, plan, note = plan_wrapper.declare(model, show_cache_on=str(unique_id or ""), cache=options)
        name = type(model.get_model_object("diffusion_model")).__name__
        described = compiler.describe_cache(options, name)
        report, problem = described.text, described.problem
        if not problem:  # else the report says why it cannot be used, and that models compile without it
            report += _what_comes_next(plan)
        if note:
            report += f" {note}"
        show_report(report, problem, unique_id)
        return (patched, report)


def _what_comes_next(plan) -> str:
    if plan.compile is None:
        return (" It is used once Kiln › Compile UNet is in the chain (before or after this node); hit or miss is "
                "decided per graph on the first sampling step, and this node and the log say which, and why.")
    if plan.compile.lowering.uses_inductor:
        return " Hit or miss is decided per graph on the first sampling step; this node and the log say which, and why."
    return f" Compile mode {plan.compile.mode!r} does not use Inductor: nothing to cache."


NODE_CLASS_MAPPINGS = {"KilnCacheGraph": KilnCacheGraph}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnCacheGraph": "Kiln › Cache Graph"}
