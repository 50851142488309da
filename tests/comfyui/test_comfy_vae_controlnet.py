"""Kiln › Compile VAE and Kiln › Compile ControlNet on ComfyUI's own classes and nodes: the same images
as without Kiln, the given VAE / ControlNet unchanged, no recompile when a tile, image size or
ControlNet strength changes. Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")

import comfy.controlnet  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
import nodes  # noqa: E402
import torch  # noqa: E402

from kiln.nodes import plan_wrapper  # noqa: E402
from kiln.nodes.compile_controlnet import KilnCompileControlNet  # noqa: E402
from kiln.nodes.compile_vae import KilnCompileVAE  # noqa: E402
from comfy_testing import compile_unet, make_tiny_controlnet, make_tiny_sd15_patcher  # noqa: E402
from testing_utils import psnr  # noqa: E402

# 4 levels of 32 channels: the 8x compression ComfyUI's VAE code assumes, at a tiny size
TINY_VAE = {"params": {"embed_dim": 4, "ddconfig": {
    "double_z": True, "z_channels": 4, "resolution": 64, "in_channels": 3, "out_ch": 3, "ch": 32,
    "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}}}


@pytest.fixture(autouse=True)
def inference_mode():
    """ComfyUI runs every node under inference mode: tensors made outside it are another dispatch key set,
    which TorchDynamo guards on (a mix recompiles, and Kiln's stats say so)."""
    with torch.inference_mode():
        yield


def compiles(compiled):
    return compiled.kiln_model.stats.compile_count


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    vae = comfy.sd.VAE(sd={}, config=TINY_VAE)
    for p in vae.first_stage_model.parameters():  # ComfyUI's ops leave weights uninitialised
        p.data.normal_(0, 0.05)
    return vae


@pytest.fixture(scope="module")
def compiled_vae(vae):
    compiled, report = KilnCompileVAE().compile(vae, mode="fast", compile="decode and encode", unique_id="21")
    assert "decode and encode on first use" in report
    return compiled


def test_compile_vae_decodes_and_encodes_like_the_vae_it_was_given(vae, compiled_vae, monkeypatch):
    shown = []
    monkeypatch.setattr(plan_wrapper, "show_text", lambda node, text: shown.append((node, text)))
    torch.manual_seed(1)
    latent = {"samples": torch.randn(1, 4, 12, 10)}
    image = torch.rand(1, 48, 40, 3)
    decoded = nodes.VAEDecode().decode(compiled_vae, latent)[0]
    assert psnr(decoded, nodes.VAEDecode().decode(vae, latent)[0]) >= 40
    encoded = nodes.VAEEncode().encode(compiled_vae, image)[0]["samples"]
    assert psnr(encoded, nodes.VAEEncode().encode(vae, image)[0]["samples"]) >= 40
    decode = compiled_vae.patcher.object_patches["decode"]
    assert compiles(decode) == 1 and decode.kiln_model.stats.fallback is None
    assert shown and shown[0][0] == "21" and shown[0][1].startswith("Kiln compiled graph 0")
    # the VAE given is unchanged: its model's decode is the class's own again once it is loaded
    assert "decode" not in vae.patcher.object_patches
    nodes.VAEDecode().decode(vae, latent)
    assert "decode" not in vae.first_stage_model.__dict__ or vae.first_stage_model.decode.__self__ is vae.first_stage_model


def test_tiled_decode_and_other_sizes_compile_a_bounded_number_of_graphs_once(vae, compiled_vae):
    torch.manual_seed(2)
    latent = {"samples": torch.randn(1, 4, 20, 17)}  # tiles of 8 latents: full tiles and smaller edge tiles
    decode = compiled_vae.patcher.object_patches["decode"]

    def decode_all():
        tiled = nodes.VAEDecodeTiled().decode(compiled_vae, latent, tile_size=64, overlap=16)[0]
        nodes.VAEDecode().decode(compiled_vae, {"samples": torch.randn(1, 4, 14, 6)})
        nodes.VAEDecode().decode(compiled_vae, {"samples": torch.randn(2, 4, 14, 6)})  # batch 1 has a graph of its own
        nodes.VAEDecode().decode(compiled_vae, {"samples": torch.randn(3, 4, 10, 6)})
        return tiled

    tiled = decode_all()
    assert psnr(tiled, nodes.VAEDecodeTiled().decode(vae, latent, tile_size=64, overlap=16)[0]) >= 40
    stats = decode.kiln_model.stats
    # tiles are views (made contiguous: no stride recompile); torch's convolution picks another kernel
    # below a feature-map size (a guard on the tiny edge tiles), and batch 1 is a graph of its own
    assert compiles(decode) <= 3, stats.summary()
    assert not [c for c in stats.recompiles if "stride" in c.reason or "dispatch key" in c.reason], stats.summary()
    settled = compiles(decode)
    decode_all()  # the next prompt: every tile and size again, nothing compiled
    assert compiles(decode) == settled, stats.summary()


def sample_with_control(model, control_net, strength, hint, seed=3):
    torch.manual_seed(seed)
    pos, neg = [[torch.randn(1, 7, 32), {}]], [[torch.randn(1, 7, 32), {}]]
    pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, control_net, hint, strength, 0.0, 1.0)
    noise = torch.randn(1, 4, 16, 16)
    return comfy.sample.sample(model, noise, 2, 7.0, "euler", "normal", pos, neg, torch.zeros(1, 4, 16, 16),
                               disable_pbar=True, seed=seed)


def test_compile_controlnet_samples_like_eager_across_strengths_without_recompiling():
    base = make_tiny_sd15_patcher(seed=0)
    control_net = make_tiny_controlnet()
    hint = torch.rand(1, 128, 128, 3)
    kiln_unet = compile_unet(base, mode="fast")[0]
    kiln_control, report = KilnCompileControlNet().compile(control_net, mode="fast")
    assert "Kiln will compile ControlNet" in report and control_net.control_model is not kiln_control.control_model
    counts = []
    for strength in (1.0, 0.5, 0.0, 0.8):
        got = sample_with_control(kiln_unet, kiln_control, strength, hint)
        want = sample_with_control(base, control_net, strength, hint)
        assert psnr(got, want) >= 40, strength
        counts.append(compiles(kiln_control.control_model))
    assert counts[0] >= 1 and counts[-1] == counts[0], kiln_control.control_model.kiln_model.stats.summary()
    assert kiln_control.control_model.kiln_model.stats.fallback is None


def test_a_controlnet_kiln_does_not_compile_passes_through_saying_why():
    lora_like = comfy.controlnet.ControlLora({}, global_average_pooling=False)
    same, report = KilnCompileControlNet().compile(lora_like, mode="fast")
    assert same is lora_like and "Control LoRA" in report and "runs eagerly" in report
