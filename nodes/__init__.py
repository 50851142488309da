"""Kiln's ComfyUI nodes: thin declarations over the `compiler` library.

Each node module declares its nodes; what they share is in shared.py (widgets, the eager report, a
workflow's cache) and plan_wrapper.py (how a Kiln plan rides on a MODEL). No node module imports
another. The compiler is imported once, guarded (loaded.py): if it cannot load, the nodes still
register and pass models through, saying why in their report."""
from . import block_inputs, cache_graph, comfy_layers, compile_controlnet, compile_unet, compile_vae, quantize_model, step_cache

block_inputs.register()  # the compiler reads ComfyUI's transformer_options through this hook
comfy_layers.register()  # ... and runs ComfyUI's fp8 matmul layers through their traceable stand-in

_NODES = (compile_unet, quantize_model, cache_graph, compile_vae, compile_controlnet, step_cache)
NODE_CLASS_MAPPINGS = {name: cls for module in _NODES for name, cls in module.NODE_CLASS_MAPPINGS.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: text for module in _NODES for name, text in module.NODE_DISPLAY_NAME_MAPPINGS.items()}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
