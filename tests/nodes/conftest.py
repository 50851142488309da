import pytest


@pytest.fixture(autouse=True)
def _comfy_host(comfy_host):
    """Kiln's nodes run in ComfyUI: the compiler reads block arguments ComfyUI's way (nodes/block_inputs.py)."""
    yield
