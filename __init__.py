"""Kiln: compile, quantize and cache diffusion models.

Two ways in:
- Python: `import kiln; unet = kiln.compile(unet)` (no ComfyUI needed).
- ComfyUI: clone this folder into `ComfyUI/custom_nodes/`; the nodes register below.
"""
__version__ = "0.1.0"

import logging as _logging

try:
    from .compiler import CompileOptions, KilnStats, KilnUnavailable, OptionsError, compile, stats
except Exception as _exc:  # noqa: BLE001  a broken or too-old torch must not break ComfyUI's start-up
    IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"
    _logging.getLogger("kiln").error("Kiln's compiler cannot load (%s); Kiln nodes will pass models through eagerly", IMPORT_ERROR)
else:
    IMPORT_ERROR = None

try:  # inside ComfyUI only; the library and its tests run without it
    import comfy  # noqa: F401
except ImportError:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["compile", "stats", "CompileOptions", "KilnStats", "KilnUnavailable", "OptionsError",
           "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
