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

from .compile_unet import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "COMPILER_LOAD_ERROR"]
