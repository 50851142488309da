"""testing/digits_unet.py trains the tiny denoiser the step-cache tests and benches use, once, into the
user's cache: a few steps of it must run whatever autograd mode the caller is in (the ComfyUI bench
test calls it under inference mode, where it failed in backward when the cache was empty)."""
import pytest
import torch

pytest.importorskip("sklearn", reason="the digits come from scikit-learn")
pytest.importorskip("diffusers", reason="the digits denoiser is a diffusers UNet")

from kiln.testing import digits_unet  # noqa: E402


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_training_runs_under_the_caller_s_inference_mode_or_no_grad(mode):
    with mode():
        model, report = digits_unet.train(steps=2, batch=4)
    assert report.steps == 2 and report.final_loss > 0 and not any(p.requires_grad for p in model.parameters())

