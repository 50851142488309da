"""benchmarks/step_cache_comfy.py (Kiln's step cache beside core's EasyCache through ComfyUI's sampling, on the
trained digits denoiser) must not rot: one seed of it. Needs the trained model (cached, or scikit-learn to
train it). Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import torch  # noqa: E402

from kiln.benchmarks import step_cache_comfy  # noqa: E402
from kiln.testing import digits_unet  # noqa: E402

if not digits_unet.cache_path().exists():
    pytest.importorskip("sklearn", reason="the digits denoiser is not trained yet and scikit-learn is missing")


def test_one_seed_of_the_side_by_side():
    with torch.inference_mode():
        result = step_cache_comfy.run(seeds=1, log=lambda msg: None)
    rows = {(r["steps"], r["cache"], r["threshold"]): r for r in result["rows"]}
    for steps in step_cache_comfy.STEP_COUNTS:
        assert rows[(steps, "no cache", None)]["calls"] == steps
        kiln = rows[(steps, "kiln", 0.05)]
        assert kiln["psnr_min"] >= 30 and kiln["calls"] <= steps / 1.6, kiln
        if (steps, "easycache", 0.2) in rows:  # core's EasyCache, where this ComfyUI has it, skips too
            assert rows[(steps, "easycache", 0.2)]["calls"] < steps
