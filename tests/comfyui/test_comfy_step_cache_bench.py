"""benchmarks/step_cache_comfy.py (Kiln's step cache beside core's EasyCache and First Block Cache at equal model
calls, through ComfyUI's sampling) must not rot: one seed of it, on the trained digits denoiser. Needs diffusers and
the trained model (cached, or scikit-learn to train it). Runs when COMFYUI_PATH points at a ComfyUI tree; skips
otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import torch  # noqa: E402

from kiln.benchmarks import step_cache_comfy  # noqa: E402
from kiln.choices import DEFAULT_STEP_CACHE_METHOD  # noqa: E402
from kiln.testing import digits_unet  # noqa: E402

pytest.importorskip("diffusers", reason="the digits denoiser is a diffusers UNet (Kiln's bench extra)")
if not digits_unet.cache_path().exists():
    pytest.importorskip("sklearn", reason="the digits denoiser is not trained yet and scikit-learn is missing")


def test_one_seed_of_the_side_by_side_at_the_default_s_model_calls():
    with torch.inference_mode():
        result = step_cache_comfy.run(seeds=1, step_counts=(20,), models=("digits",), log=lambda msg: None)
    rows = {r["setting"]: r for r in result["rows"]}
    assert rows["no cache"]["calls"] == 20
    default = rows[f"kiln {DEFAULT_STEP_CACHE_METHOD} default"]
    assert default["psnr_min"] >= 30 and default["calls"] <= 20 / 1.4, default
    matched = [r for r in result["rows"] if "matched" in r]
    names = {r["setting"].split()[0] for r in matched}
    assert "first_block" in names and ("easycache" in names) == any(s.startswith("easycache") for s in rows)
    for row in matched:
        assert row["matched_to"] == default["calls"]
        assert {"over": row["calls"] >= default["calls"], "under": row["calls"] <= default["calls"],
                "equal": row["calls"] == default["calls"]}[row["matched"]], row
