"""Kiln's ComfyUI nodes: thin declarations over the `compiler` library.

The compiler is imported here once, guarded: if it cannot load (a torch too old for it, a broken
install), the nodes still register and pass models through, saying why in their report."""
import logging

try:
    from .. import compiler
    COMPILER_LOAD_ERROR = ""
except Exception as _exc:  # noqa: BLE001  a broken compiler must not break ComfyUI's start-up
    compiler = None
    COMPILER_LOAD_ERROR = f"Kiln's compiler could not load ({type(_exc).__name__}: {_exc})"
    logging.getLogger("kiln").error("%s; Kiln nodes will pass models through eagerly", COMPILER_LOAD_ERROR)

from . import compile_unet, quantize_model  # noqa: E402

NODE_CLASS_MAPPINGS = {**compile_unet.NODE_CLASS_MAPPINGS, **quantize_model.NODE_CLASS_MAPPINGS}
NODE_DISPLAY_NAME_MAPPINGS = {**compile_unet.NODE_DISPLAY_NAME_MAPPINGS, **quantize_model.NODE_DISPLAY_NAME_MAPPINGS}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "COMPILER_LOAD_ERROR"]
