"""testing/textures_dit.py: its textures, Flux's packing, the shifted sigmas, and a few steps of its
training (the full training runs once, into the user's cache, when a bench needs it)."""
import pytest
import torch

pytest.importorskip("diffusers", reason="the textures transformer is a diffusers Flux transformer")

from kiln.testing import textures_dit  # noqa: E402


def test_textures_pack_into_flux_tokens_and_back():
    latents = textures_dit.texture_latents(torch.arange(len(textures_dit.TEXTURES)))
    assert latents.shape == (8, 4, 16, 16) and latents.abs().max() <= 1
    tokens = textures_dit.pack(latents)
    assert tokens.shape == (8, 64, 16) and torch.equal(tokens[0, 0, :4], latents[0, 0, :2, :2].reshape(-1))
    assert torch.equal(textures_dit.unpack(tokens, 16, 16), latents)


def test_the_sigmas_run_from_1_to_0_unevenly():
    sigmas = textures_dit.sigmas(10)
    steps = sigmas[:-1] - sigmas[1:]
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (steps > 0).all() and steps[-1] > 2 * steps[0]


def test_a_few_training_steps_run_under_the_caller_s_inference_mode_and_sample():
    with torch.inference_mode():
        model, report = textures_dit.train(steps=2, batch=2)
        out = textures_dit.sample(model, torch.tensor([3]), steps=2, seed=0)
    assert report.steps == 2 and report.final_loss > 0 and not any(p.requires_grad for p in model.parameters())
    assert out.shape == (1, 4, 16, 16) and torch.isfinite(out).all()
    assert textures_dit.cache_path().name == f"textures-dit-v{textures_dit.VERSION}.pt"
