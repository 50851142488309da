"""ComfyUI's process-wide settings, made once before any test module here imports comfy: ComfyUI
reads them when its modules load (the attention implementation among them), so every test module
must see the same ones. They are what a CPU server started with `main.py --cpu
--use-pytorch-cross-attention` runs with. Without COMFYUI_PATH the test modules skip themselves."""
import os
import sys

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if COMFYUI_PATH and os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    sys.path.insert(0, COMFYUI_PATH)
    try:
        import comfy.cli_args
    except ImportError:  # a broken tree: the modules' importorskip says so
        pass
    else:
        comfy.cli_args.args.cpu = True  # what `main.py --cpu` sets, before model_management reads it
        comfy.cli_args.args.use_pytorch_cross_attention = True  # SDPA attention, as such a server


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _comfy_host(comfy_host):
    """In a ComfyUI process Kiln's nodes have registered ComfyUI's block conventions (nodes/block_inputs.py)."""
    yield
