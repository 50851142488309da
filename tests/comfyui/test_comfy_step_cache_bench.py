"""benchmarks/step_cache_comfy.py (Kiln's step cache beside core's EasyCache through ComfyUI's sampling, on the
trained digits denoiser) must not rot: one seed of it. Needs diffusers and the trained model (cached, or
scikit-learn to train it). Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import torch  # noqa: E402

from kiln.benchmarks import step_cache_comfy  # noqa: E402
from kiln.testing import digits_unet  # noqa: E402

pytest.importorskip("diffusers", reason="the digits denoiser is a diffusers UNet (Kiln's bench extra)")
if not digits_unet.cache_path().exists():
    pytest.importorskip("sklearn", reason="the digits denoiser is not trained yet and scikit-learn is missing")


def test_one_seed_of_the_eager_side_by_side():
    with torch.inference_mode():
        result = step_cache_comfy.run(seeds=1, groups=("eager",), log=lambda msg: None)
    rows = {(r["steps"], r["setting"]): r for r in result["rows"]}
    for steps in step_cache_comfy.STEP_COUNTS:
        assert rows[(steps, "no cache")]["calls"] == steps
        for setting in ("kiln reuse 0.05", "kiln first_block 0.15"):   # each method's default
            row = rows[(steps, setting)]
            assert row["psnr_min"] >= 30 and row["ssim_min"] > 0.9 and row["calls"] <= steps / 1.6, row
        if (steps, "easycache 0.2") in rows:  # core's EasyCache, where this ComfyUI has it, skips too
            assert rows[(steps, "easycache 0.2")]["calls"] < steps
    assert all(r["group"] == "eager" and r["seconds"] > 0 for r in result["rows"])
