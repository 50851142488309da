"""Kiln's client for a running ComfyUI: HTTP (comfy.py), its websocket (websocket.py), workflows in UI and
API format (workflow.py) and the `kiln queue` command (queue.py). Standard library only, besides
Kiln's own torch-free records (events.py): its modules import neither ComfyUI, torch nor the compiler."""
