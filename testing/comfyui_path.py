"""The ComfyUI tree a script measures with: COMFYUI_PATH, put on the import path in CPU mode."""
from __future__ import annotations

import os
import sys


def import_comfyui() -> str:
    """Put COMFYUI_PATH's tree first on the import path and set ComfyUI's CPU mode (what `main.py
    --cpu` sets, before comfy.model_management reads it); the tree's path. Exits with the reason if
    COMFYUI_PATH is not a ComfyUI tree."""
    path = os.environ.get("COMFYUI_PATH")
    if not path or not os.path.isdir(os.path.join(path, "comfy")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI tree and run this with its Python")
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    return path
