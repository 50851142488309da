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

from . import cache_graph, compile_controlnet, compile_unet, compile_vae, quantize_model  # noqa: E402

_NODES = (compile_unet, quantize_model, cache_graph, compile_vae, compile_controlnet)
NODE_CLASS_MAPPINGS = {name: cls for module in _NODES for name, cls in module.NODE_CLASS_MAPPINGS.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: text for module in _NODES for name, text in module.NODE_DISPLAY_NAME_MAPPINGS.items()}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "COMPILER_LOAD_ERROR"]
