"""Kiln › Step Cache: MODEL in, MODEL out that skips the model evaluations a sampling run does not need.

The rule and its state are the compiler's (compiler/step_cache/decision.py); this node rides on ComfyUI's
sampling wrappers. OUTER_SAMPLE starts a fresh StepCache for every sampling run (a new prompt, size,
step count, sampler or denoise starts afresh) and shows its report when the run ends. APPLY_MODEL
puts each model call through it: the input as the model sees it (`model_sampling.calculate_input`)
and the noise prediction in ComfyUI's k-diffusion terms, `(x - denoised) / sigma` (what an eps model
outputs; for v- and flow models the same quantity derived), keyed by the conds in the batch
(`transformer_options["uuids"]`), so split and batched CFG both keep per-cond state. A computed call
returns the model's own denoised output; a skipped one `x - sigma * the estimate`. With method
first_block, each call runs inside the compiler's probe of the diffusion model's first block, and a
skipped call ends there. The decision is made outside the compiled graphs: with Kiln › Compile UNet in
the chain, the graphs are the same ones and a new threshold recompiles nothing.
"""
from __future__ import annotations

import logging

from ..choices import (DEFAULT_STEP_CACHE_METHOD, MAX_ERROR_BUDGET, METHOD_THRESHOLD, STEP_CACHE_METHODS, STEP_CACHE_SETTINGS,
                       tooltip)
from . import plan_wrapper, shared

log = logging.getLogger("kiln")

WRAPPER_KEY = "kiln_step_cache"
COND_NAMES = {0: "cond", 1: "uncond"}  # ComfyUI's transformer_options["cond_or_uncond"] values


class KilnStepCache:
    DESCRIPTION = ("Skips the sampling steps whose model output would change little, answering them from the last "
                   "computed steps (forecast, or reused). Works eagerly or with Kiln › Compile UNet; after each "
                   "sampling run it shows how many model calls it computed and skipped, and the estimated error spent.")
    CATEGORY = "Kiln"
    FUNCTION = "apply"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("the model, its sampling runs through the step cache", "the step cache's settings")

    @classmethod
    def INPUT_TYPES(cls):
        def number(name, lowest, highest, step):
            default, meaning = STEP_CACHE_SETTINGS[name]
            kind = "INT" if isinstance(default, int) else "FLOAT"
            return (kind, {"default": default, "min": lowest, "max": highest, "step": step, "tooltip": meaning})

        return {
            "required": {
                "model": ("MODEL",),
                "method": (list(STEP_CACHE_METHODS), {"default": DEFAULT_STEP_CACHE_METHOD,
                                                      "tooltip": tooltip(STEP_CACHE_METHODS)}),
                "threshold": number("threshold", METHOD_THRESHOLD, 10.0, 0.005),
                "start_percent": number("start_percent", 0.0, 1.0, 0.01),
                "end_percent": number("end_percent", 0.0, 1.0, 0.01),
                "max_consecutive_skips": number("max_consecutive_skips", 0, 100, 1),
            },
            # optional: workflows saved before it existed still load (and get the default)
            "optional": {"error_budget": number("error_budget", 0.0, MAX_ERROR_BUDGET, 0.01)},
            "hidden": {"unique_id": "UNIQUE_ID"},  # the node shows each sampling run's report
        }

    def apply(self, model, method=DEFAULT_STEP_CACHE_METHOD, threshold=None, start_percent=None, end_percent=None,
              max_consecutive_skips=None, error_budget=None, unique_id=None):
        from ..loaded import COMPILER_LOAD_ERROR, compiler

        if compiler is None:
            return shared.eager(model, COMPILER_LOAD_ERROR)
        given = {"method": method, "threshold": threshold, "start_percent": start_percent, "end_percent": end_percent,
                 "max_consecutive_skips": max_consecutive_skips, "error_budget": error_budget}
        # a bad value raises StepCacheError naming it: ComfyUI shows it on the node
        options = compiler.StepCacheOptions.from_mapping({k: v for k, v in given.items() if v is not None})
        unavailable = plan_wrapper.missing_extension_points()
        if unavailable:
            return shared.eager(model, unavailable)
        from comfy.patcher_extension import WrappersMP

        sampling = StepCacheSampling(compiler.StepCache(options), str(unique_id or ""), compiler)
        patched = model.clone()
        for kind, wrapper in ((WrappersMP.OUTER_SAMPLE, sampling.outer_sample), (WrappersMP.APPLY_MODEL, sampling.apply_model)):
            patched.remove_wrappers_with_key(kind, WRAPPER_KEY)
            patched.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper)
        report = (f"Kiln step cache ({options.method}): threshold {options.threshold:g}, every step computes before "
                  f"{options.start_percent:.0%} and from {options.end_percent:.0%} of each sampling run, at most "
                  f"{options.max_consecutive_skips} skipped in a row, an estimated error of at most "
                  f"{options.error_budget:g} spent per run; its report comes after each run.")
        log.info(report)
        return (patched, report)


class StepCacheSampling:
    """The two wrappers of one Step Cache node's model, sharing its StepCache."""

    def __init__(self, cache, node_id: str, compiler):
        self.cache = cache
        self.node_id = node_id
        self.sigmas = None  # the run's schedule: a call's progress is its sigma's place in it
        self.compiler = compiler  # method first_block: its probe (compiler/step_cache/first_block_probe.py)
        self.first_block = None  # (diffusion model, its first block), found once per model

    def outer_sample(self, executor, *args, **kwargs):
        sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
        self.cache.reset()
        self.sigmas = sigmas.detach().float().cpu()
        try:
            return executor(*args, **kwargs)
        finally:
            report = self.cache.report()
            self.sigmas = None
            if report.computed + report.skipped:
                log.info("Kiln: %s", report.line())
                plan_wrapper.show_text(self.node_id, f"Kiln {report.line()}")

    def apply_model(self, executor, *args, **kwargs):
        x, sigma = args[0], args[1]
        options = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
        if self.sigmas is None or len(self.sigmas) < 2:  # not inside a sampling run Kiln saw begin
            return executor(*args, **kwargs)
        model_sampling = executor.class_obj.model_sampling
        level = float(sigma.detach().float().max())
        step = int((self.sigmas[:-1] - level).abs().argmin())
        # the run's last step always computes: its progress is 1, past any end_percent
        progress = 1.0 if step == len(self.sigmas) - 2 else step / (len(self.sigmas) - 1)
        s = sigma.reshape(sigma.shape[:1] + (1,) * (x.dim() - 1)).to(x.dtype)
        computed = []
        probed = self._probed(executor.class_obj.diffusion_model) if self.cache.options.method == "first_block" else None

        def compute():
            if probed is None:
                denoised = executor(*args, **kwargs)
            else:
                with probed:
                    denoised = executor(*args, **kwargs)
            computed.append(denoised)
            return (x - denoised) / s

        kinds = options.get("cond_or_uncond") or ()
        key = tuple(str(u) for u in options.get("uuids") or ()) or tuple(kinds) or "all"
        label = "+".join(COND_NAMES.get(k, str(k)) for k in kinds) or "all"
        noise = self.cache.step(model_sampling.calculate_input(sigma, x), progress, compute, key=key, label=label,
                                time=level)  # method forecast extrapolates in sigma
        return computed[0] if computed else x - s * noise

    def _probed(self, diffusion_model):
        """method first_block: the context in which the model's first block reports to the cache."""
        if self.first_block is None or self.first_block[0] is not diffusion_model:
            self.first_block = (diffusion_model, self.compiler.first_block_of(diffusion_model)[1])
        return self.compiler.first_block_probed(self.cache, self.first_block[1])


NODE_CLASS_MAPPINGS = {"KilnStepCache": KilnStepCache}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnStepCache": "Kiln › Step Cache"}
