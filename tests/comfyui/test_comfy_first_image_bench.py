"""benchmarks/first_image_server.py must not rot: eager and Kiln's compile, each in a cold ComfyUI server
of its own. In a module of its own, so that no other module's server or headless browser is still up
(and busy) while it starts its servers. Runs when COMFYUI_PATH points at a ComfyUI tree whose models
folder holds `checkpoints/rand_sd15_tiny.safetensors` (random weights are enough); skips otherwise."""
import os
import sys
from pathlib import Path

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
COMFY = Path(COMFYUI_PATH)
CHECKPOINT = COMFY / "models" / "checkpoints" / "rand_sd15_tiny.safetensors"
if not CHECKPOINT.exists():
    pytest.skip(f"no SD1.5 checkpoint {CHECKPOINT} (random weights are enough)", allow_module_level=True)
PORT = 8196


@pytest.mark.slow
def test_the_first_image_bench_starts_a_cold_server_per_variant(tmp_path):
    """benchmarks/first_image_server.py must not rot: eager and Kiln's compile, one step at 64x64, each in
    a server of its own with its own Inductor cache."""
    from kiln.benchmarks import first_image_server

    result = first_image_server.run(COMFY, CHECKPOINT, sys.executable, ["eager", "kiln"], steps=1, size=64,
                                    port=PORT, folder=tmp_path, log=lambda msg: None)
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows["eager"]["first_image_s"] > 0 and rows["kiln"]["next_image_s"] > 0
    assert min(rows["kiln"]["psnr_db"]) >= 40   # Kiln's compile: the eager image
    assert any((tmp_path / "kiln" / "inductor-cache").iterdir())  # Kiln's server compiled into its own cache
    assert "kiln" in first_image_server.format_table(result)
