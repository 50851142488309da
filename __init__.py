"""Kiln: compile, quantize and cache diffusion models.

Two ways in:
- Python: `import kiln; unet = kiln.compile(unet)` (no ComfyUI needed).
- ComfyUI: clone this folder into `ComfyUI/custom_nodes/`; the nodes register below.
"""
import logging as _logging

__version__ = "0.1.0"
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
IMPORT_ERROR = None

# A lone-file import of this __init__ (pytest's package setup does one) has no package to import from.
if __package__:
    try:
        from .compiler import CompileOptions, KilnStats, KilnUnavailable, OptionsError, compile, stats  # noqa: F401
    except Exception as _exc:  # noqa: BLE001  a broken or too-old torch must not break ComfyUI's start-up
        IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"
        _logging.getLogger("kiln").error("Kiln's compiler cannot load (%s); Kiln nodes will pass models through eagerly",
                                         IMPORT_ERROR)

    try:  # inside ComfyUI only; the library and its tests run without it
        import comfy.patcher_extension  # noqa: F401
    except ImportError:
        pass
    else:
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

__all__ = ["compile", "stats", "CompileOptions", "KilnStats", "KilnUnavailable", "OptionsError",
           "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "IMPORT_ERROR", "__version__"]
