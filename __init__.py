"""Kiln: compile, quantize and cache diffusion models.

Two ways in:
- Python: `import kiln; unet = kiln.compile(kiln.quantize(unet, kiln.QuantizeOptions()), kiln.CompileOptions())`
  (no ComfyUI needed; `kiln.compile(kiln.quantize(unet))` in short).
- ComfyUI: clone this folder into `ComfyUI/custom_nodes/`; the nodes register below.
"""
import logging as _logging
import sys as _sys

__version__ = "0.1.0"
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
_log = _logging.getLogger("kiln")

# A lone-file import of this __init__ (pytest's package setup does one) has no package to import from.
if __package__:
    from .loaded import COMPILER_LOAD_ERROR, compiler  # noqa: F401  the compiler, or why it could not load

    if compiler is not None:
        from .compiler import (CacheOptions, CompileOptions, KilnModel, KilnPlan, KilnStats,  # noqa: F401
                               KilnUnavailable, LayerPolicy, OptionsError, QuantizeError, QuantizeOptions,
                               QuantReport, StepCacheOptions, compile, load_quantized, quant_report, quantize,
                               save_quantized, stats, step_cached, wait_lowered)

    if "comfy" in _sys.modules:  # loaded by ComfyUI as a custom node pack (ComfyUI imports comfy first)
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
        from .nodes import plan_wrapper as _plan_wrapper

        _missing = _plan_wrapper.missing_extension_points()
        if _missing:
            _log.error("Kiln: %s; Kiln's nodes pass models through unchanged and say so in their report", _missing)
        else:
            _log.log(*_plan_wrapper.comfyui_range_note(_plan_wrapper.comfyui_version()))

__all__ = ["compile", "stats", "wait_lowered", "step_cached", "StepCacheOptions", "quantize", "quant_report", "save_quantized", "load_quantized", "QuantizeError",
           "QuantReport", "QuantizeOptions", "LayerPolicy", "CompileOptions", "CacheOptions", "KilnModel", "KilnPlan",
           "KilnStats", "KilnUnavailable", "OptionsError", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS",
           "__version__"]
