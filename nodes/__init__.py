"""Kiln's ComfyUI nodes: thin declarations over the `compiler` library."""
from .compile_unet import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
