"""testing/shapes_unet.py: the drawn shapes it trains on, and a few steps of its training (the full
training runs once, into the user's cache, when a bench needs it)."""
import pytest
import torch

pytest.importorskip("diffusers", reason="the shapes denoiser is a diffusers UNet")

from kiln.testing import shapes_unet  # noqa: E402


def test_each_kind_is_drawn_at_its_size_in_its_own_channel_mix():
    classes = torch.arange(len(shapes_unet.SHAPES))
    latents = shapes_unet.shape_latents(classes)
    assert latents.shape == (len(classes), 4, shapes_unet.LATENT, shapes_unet.LATENT) and latents.abs().max() <= 1
    signs = (latents[:, 0] > 0) == (shapes_unet._mixes()[classes, 0] > 0)[:, None, None]
    assert all(0 < s.float().mean() < 1 for s in signs)   # each shape covers part of the latent, not all of it


def test_a_few_training_steps_run_under_the_caller_s_inference_mode_and_sample():
    with torch.inference_mode():
        model, report = shapes_unet.train(steps=2, batch=2)
        out = shapes_unet.sample(model, torch.tensor([9]), steps=2, seed=0)   # 9: a kind index wraps
    assert report.steps == 2 and report.final_loss > 0 and not any(p.requires_grad for p in model.parameters())
    assert out.shape == (1, 4, shapes_unet.LATENT, shapes_unet.LATENT) and torch.isfinite(out).all()
    assert shapes_unet.cache_path().name == f"shapes-unet-v{shapes_unet.VERSION}.pt"
