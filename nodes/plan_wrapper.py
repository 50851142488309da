"""How a Kiln plan rides on a ComfyUI MODEL, and how it runs: one APPLY_MODEL wrapper.

Each Kiln node clones the ModelPatcher and adds its part to the plan kept in the clone's model
options under PLAN_KEY; the clone gets one Kiln wrapper, which swaps the plan's KilnModel in
for `diffusion_model` only while the model runs (as core's TorchCompileModel does) and puts the
original back afterwards. The original module keeps owning the weights, so LoRA, merges and
low-VRAM offload patch it as usual and the compiled code reads those live weights. Everything
that decides what runs (the plan's steps, eager fallback, cancel, shape hints) is the compiler's.
"""
from __future__ import annotations

import logging

log = logging.getLogger("kiln")

PLAN_KEY = "kiln_plan"              # model_options[PLAN_KEY]: the KilnPlan
WRAPPER_KEY = "kiln.compile"        # APPLY_MODEL wrapper key
CORE_COMPILE_KEY = "torch.compile"  # ComfyUI core's TorchCompileModel wrapper
MIN_COMFYUI = "0.3.7"               # the first ComfyUI with comfy.patcher_extension's model wrappers


def missing_extension_points() -> str:
    """Why this ComfyUI cannot carry a Kiln plan ("" if it can)."""
    try:
        from comfy.patcher_extension import WrappersMP

        WrappersMP.APPLY_MODEL  # noqa: B018
    except (ImportError, AttributeError) as exc:
        try:
            from comfyui_version import __version__ as version
        except ImportError:
            version = "unknown"
        return (f"this ComfyUI (version {version}) has no model wrappers ({exc}); Kiln needs ComfyUI {MIN_COMFYUI} "
                "or newer")
    return ""


def declare(model_patcher, show_cache_on: str = "", **part):
    """A clone of `model_patcher` whose plan has `part` added, with Kiln's wrapper installed.
    `show_cache_on`: the id of a node that shows each cache hit or miss as it happens (Cache Graph's);
    a node declared later keeps the one set earlier. Returns (clone, plan, note); the note says if
    core's TorchCompileModel wrapper was replaced."""
    from comfy.patcher_extension import WrappersMP

    from ..compiler import KilnPlan

    patched = model_patcher.clone()
    before = patched.model_options.get(PLAN_KEY) or KilnPlan()
    plan = before.with_parts(**part)
    patched.model_options[PLAN_KEY] = plan
    earlier = patched.get_wrappers(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    show_cache_on = show_cache_on or (earlier[0].show_cache_on if earlier else "")
    return patched, plan, _install(patched, KilnApplyModel(plan, show_cache_on))


class KilnApplyModel:
    """The APPLY_MODEL wrapper: runs the diffusion model as the plan's KilnModel."""

    def __init__(self, plan, show_cache_on: str = ""):
        self.plan = plan
        self.show_cache_on = show_cache_on  # node id that shows cache hits and misses in ComfyUI's UI

    def __call__(self, executor, *args, **kwargs):
        import comfy.utils

        from ..compiler import model_for

        base_model = executor.class_obj
        original = comfy.utils.get_attr(base_model, "diffusion_model")
        kiln_model = model_for(original, self.plan, progress=progress_bar())
        comfy.utils.set_attr(base_model, "diffusion_model", kiln_model)
        events = len(kiln_model.stats.cache)
        try:
            return executor(*args, **kwargs)
        finally:
            comfy.utils.set_attr(base_model, "diffusion_model", original)
            if self.show_cache_on and len(kiln_model.stats.cache) > events:
                show_text(self.show_cache_on, "\n".join(e.line() for e in kiln_model.stats.cache[events:]))


def _install(model_patcher, wrapper) -> str:
    """Add Kiln's wrapper to a clone's APPLY_MODEL wrappers, replacing core's or an earlier Kiln one."""
    from comfy.patcher_extension import WrappersMP

    note = ""
    if model_patcher.get_wrappers(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY):
        model_patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY)
        note = "replaced ComfyUI's TorchCompileModel wrapper (two compilers cannot both own the model)"
    model_patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, wrapper)
    return note


def show_text(node_id: str, text: str) -> None:
    """Show `text` on a node in ComfyUI's UI (its progress text, as core's Get Image Size does).
    Headless (no server running), the log already has it."""
    try:
        from server import PromptServer
    except ImportError:
        return
    if getattr(PromptServer, "instance", None) is not None:
        PromptServer.instance.send_progress_text(text, node_id)


def progress_bar(work: str = "compile"):
    """A progress callback for Kiln's `work` (compile, quantize) that drives ComfyUI's progress bar and the log. ComfyUI's
    cancel raises from ProgressBar.update (its interrupt check): the compile stops there."""
    bar = {}

    def progress(what: str, done: int, total: int) -> None:
        import comfy.utils

        if done == 1 or "bar" not in bar:
            bar["bar"] = comfy.utils.ProgressBar(total)
        if done == 1 or done == total or done % max(1, total // 10) == 0:
            log.info("Kiln %s: %s (%d/%d)", work, what, done, total)
        bar["bar"].update_absolute(done, total)

    return progress
