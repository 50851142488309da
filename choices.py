"""Every named choice a Kiln user makes, each written once with what it means: the compile modes and
units, the cache modes, the quantization schemes and the step cache methods.

Standard library only, so ComfyUI's nodes offer the same choices (and tooltips) even when the
compiler cannot load. The compiler builds its tables on these names (compiler/backend/lowering.py,
compiler/cache/options.py, compiler/quantize/scheme.py) and refuses any other. To add a choice,
add it here and give it its row there.
"""
from __future__ import annotations

# compile mode -> what it means (compiler/backend/lowering.py says how each lowers a graph)
COMPILE_MODES = {
    "fast": "quick compile: Kiln's rewrite passes, then the rewritten FX graph runs directly (no Inductor)",
    "balanced": "default: Kiln's passes, then Inductor's default lowering",
    "max": "longest compile, most speed: Kiln's passes, then Inductor with max-autotune",
}
DEFAULT_MODE = "balanced"

# compile unit -> what it means: how a model is cut into compiled code (compiler/regional/blocks.py)
COMPILE_UNITS = {
    "auto": "blocks when the model repeats blocks, else whole",
    "blocks": "compile each distinct block once; identical blocks share its code (fastest first compile)",
    "whole": "the whole model as one graph (slowest first compile; every op in one graph)",
}

# cuda_graphs -> what it means (compiler/graphs; docs/cuda-graphs.md has the rules)
CUDA_GRAPHS = {
    "auto": "default: on a CUDA device the whole model call is recorded once and replayed as a CUDA graph where the "
            "rules hold (else it runs without graphs, saying why); on other devices there are none",
    "on": "torch's CUDA graph trees for each compiled graph (by blocks: each region's), bounded by shapes.max_cuda_graphs",
    "off": "no CUDA graphs",
}
DEFAULT_CUDA_GRAPHS = "auto"

# glue_regions -> what it means: by blocks, the model's own code outside its blocks (compiler/regional/glue.py)
GLUE_REGIONS = {
    "auto": "default: on a CUDA device, where each region's choice is measured, the glue between blocks (time "
            "embeddings, final norms) is compiled as regions of its own and kept compiled where it saves GPU time; "
            "elsewhere it runs eagerly",
    "on": "compile the glue as regions of its own on every device (each kept compiled where it measures faster)",
    "off": "the glue runs eagerly",
}
DEFAULT_GLUE_REGIONS = "auto"

# cache mode -> what it means (compiler/cache/options.py)
CACHE_MODES = {
    "use": "load a matching entry, else compile and store",
    "refresh": "compile and replace the entry",
    "off": "neither read nor write",
}

# quantization scheme -> what it stores and runs (compiler/quantize/scheme.py)
SCHEMES = {
    "int8_weight": "int8 weights, float activations",
    "int8_dynamic": "int8 weights and activations (int8 GEMM)",
    "fp8_e4m3": "ComfyUI's fp8 format (fp8 GEMM on RTX 40xx/H100 and newer)",
    "int8_tensorwise": "ComfyUI's int8 format: int8 weights, one scale per tensor (ComfyUI 0.33 loads the file)",
}
DEFAULT_SCHEME = "int8_weight"  # Quantize Model's default

# step cache method -> what it skips (compiler/step_cache/decision.py)
STEP_CACHE_METHODS = {
    "reuse": "skip the whole model while its output is estimated to change less than the threshold, "
             "reusing the last computed step's change (output - input); the estimate is the input's change "
             "times the output/input change rate last measured (EasyCache's rule)",
    "first_block": "run the model's first block; while its residual (output - input) differs from the one of the "
                   "last computed step by less than the threshold (mean absolute change, relative), skip the rest "
                   "of the model and reuse the last computed step's change (First Block Cache's rule)",
    "forecast": "decide as reuse, but answer a skipped step with the change (output - input) extrapolated from the "
                "last computed steps in the sampler's time (sigma or timestep): second order where three exist "
                "(TaylorSeer's forecast, by divided differences)",
}
DEFAULT_STEP_CACHE_METHOD = "forecast"
# each method's default threshold: their measures differ (reuse and forecast bound the calibrated estimate of
# a skip's relative error, first_block the change of the first block's residual); all chosen on the digits
# denoiser, and reported on models they were not chosen on (docs/step-cache.md)
STEP_CACHE_THRESHOLDS = {"reuse": 0.1, "first_block": 0.15, "forecast": 0.05}
METHOD_THRESHOLD = -1.0  # a threshold of -1 (the node's default): the method's own, above
MAX_ERROR_BUDGET = 10.0  # the step cache's error_budget at most: ten outputs' worth of estimated error per run
# the step cache's settings and their defaults: setting -> (default, what it means)
STEP_CACHE_SETTINGS = {
    "threshold": (METHOD_THRESHOLD, "how much change a skip may stand for, in the method's measure; 0 never skips, "
                                    "higher skips more (and drifts further from the uncached image); -1: the "
                                    "method's default (" + ", ".join(f"{m} {t:g}" for m, t in STEP_CACHE_THRESHOLDS.items())
                                    + ")"),
    "start_percent": (0.15, "steps before this share of the sampling run always compute"),
    "end_percent": (0.95, "steps from this share of the sampling run on always compute"),
    "max_consecutive_skips": (2, "after this many skipped steps in a row, the next one computes"),
    "error_budget": (1.0, "the estimated error a whole sampling run may spend on skipped steps (each skip's relative "
                          "error, its rule's estimate calibrated at the computed steps, added up); once spent, every "
                          "step computes; 0 never skips"),
}


def tooltip(choices: dict[str, str]) -> str:
    """'use: load a matching entry, else compile and store; refresh: ...': a widget's tooltip."""
    return "; ".join(f"{name}: {meaning}" for name, meaning in choices.items())
