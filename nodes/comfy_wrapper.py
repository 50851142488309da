"""How a compiled diffusion model enters ComfyUI: an APPLY_MODEL wrapper, as core's TorchCompileModel does.

The wrapper swaps the compiled module in for `diffusion_model` only while the model runs and puts
the original back afterwards, so the original module keeps owning the weights: LoRA, merges and
low-VRAM offload patch it as usual and the compiled code reads those live weights.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("kiln")

WRAPPER_KEY = "kiln.compile"
CORE_COMPILE_KEY = "torch.compile"  # ComfyUI core's TorchCompileModel wrapper


def make_apply_model_wrapper(compiled, stats, compat, key: str = "diffusion_model"):
    """`stats` is the compiled module's KilnStats; its `fallback` set means: run eagerly.
    `compat` is the compiler's compat module (failure types and shape hints, no FX here)."""
    import comfy.utils

    def kiln_apply_model(executor, *args, **kwargs):
        if stats.fallback:
            return executor(*args, **kwargs)
        # ComfyUI passes the whole sigma schedule down; its length is the step count. Without this,
        # changing the number of steps would recompile (seen in a real server: "sample_sigmas size
        # mismatch at index 0. expected 5, actual 3").
        for options in (*args, *kwargs.values()):  # BaseModel.apply_model passes transformer_options positionally
            sigmas = options.get("sample_sigmas") if isinstance(options, dict) else None
            if sigmas is not None and getattr(sigmas, "dim", lambda: 0)() == 1:
                compat.allow_any_size(sigmas)
        original = comfy.utils.get_attr(executor.class_obj, key)
        comfy.utils.set_attr(executor.class_obj, key, compiled)
        start, graphs = time.perf_counter(), stats.compile_count
        try:
            return executor(*args, **kwargs)
        except compat.compile_failure_types() as exc:
            # The compile failed, not the model: say so loudly, then run this and later steps eagerly.
            stats.fallback = f"compile failed: {compat.describe_compile_failure(exc)}"
            log.error("Kiln: %s -- running the model eagerly from now on", stats.fallback, exc_info=exc)
            comfy.utils.set_attr(executor.class_obj, key, original)
            return executor(*args, **kwargs)
        finally:
            comfy.utils.set_attr(executor.class_obj, key, original)
            new = stats.compile_count - graphs
            if new:
                log.info("Kiln: step with %d new compiled graph(s) took %.1fs (capture + passes + lowering + run)",
                         new, time.perf_counter() - start)

    return kiln_apply_model


def install(model_patcher, wrapper) -> str:
    """Add Kiln's wrapper to a clone's APPLY_MODEL wrappers, replacing core's or an earlier Kiln one."""
    from comfy.patcher_extension import WrappersMP

    note = ""
    if model_patcher.get_wrappers(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY):
        model_patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY)
        note = "replaced ComfyUI's TorchCompileModel wrapper (two compilers cannot both own the model)"
    model_patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, wrapper)
    return note


def progress_bar():
    """A progress callback for Kiln's compile that drives ComfyUI's progress bar and the log."""
    bar = {}

    def progress(what: str, done: int, total: int) -> None:
        import comfy.utils

        if done == 1 or "bar" not in bar:
            bar["bar"] = comfy.utils.ProgressBar(total)
        bar["bar"].update_absolute(done, total)
        log.info("Kiln compile: %s (%d/%d)", what, done, total)

    return progress
