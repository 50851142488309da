"""Compile UNet over ComfyUI's own quantized weights: a diffusion model file in ComfyUI's per-layer format
(`<layer>.comfy_quant` {"format": ...}, a per-tensor `weight_scale`), loaded by ComfyUI's stock loader into its
QuantizedTensor weights, compiles by blocks with the weights kept quantized, gives the same model's eager image,
serves new sizes without compiling again after the first change, and a LoRA added after Kiln applies as in eager.
Each format the running ComfyUI lists in comfy.quant_ops.QUANT_ALGOS is tested (0.8.0: the two fp8 ones; 0.33.0
also int8_tensorwise). Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import comfy.sd  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

quant_ops = pytest.importorskip("comfy.quant_ops")

from kiln.nodes.compile_unet import KilnCompileUNet  # noqa: E402
from comfy_testing import (COMFY_FORMATS, DETECTABLE_SD15, comfy_quantized, kiln_stats, lora_like_patches,  # noqa: E402
                           compile_unet, make_tiny_sd15_patcher, sample)
from testing_utils import psnr, rel_err  # noqa: E402

SIZES = (8, 12, 16)  # latent sizes: the first compiles, the first change may recompile a block once, then none


def quantized_weights(model) -> int:
    return sum(isinstance(p, quant_ops.QuantizedTensor) for p in model.model.diffusion_model.parameters())


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as ComfyUI runs every node
        yield


@pytest.fixture(scope="module")
def float_unet():
    with torch.inference_mode():
        return make_tiny_sd15_patcher(unet_config=DETECTABLE_SD15).model.diffusion_model.state_dict()


@pytest.fixture(scope="module", params=list(COMFY_FORMATS))
def stock(request, float_unet, tmp_path_factory):
    """The model ComfyUI's own Load Diffusion Model gives for the file in this format."""
    if request.param not in quant_ops.QUANT_ALGOS:
        pytest.skip(f"this ComfyUI does not read {request.param} (comfy.quant_ops.QUANT_ALGOS)")
    path = tmp_path_factory.mktemp("stock") / f"unet_{request.param}.safetensors"
    safetensors.torch.save_file(comfy_quantized(float_unet, request.param), str(path))
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(path))
    assert quantized_weights(model) > 0, f"ComfyUI loaded no {request.param} weight as a QuantizedTensor"
    return model


@pytest.mark.slow
def test_compile_over_comfyuis_quantized_weights(stock):
    held = quantized_weights(stock)
    compiled, report = KilnCompileUNet().compile(stock)  # the defaults: mode balanced, by blocks
    images = {size: sample(compiled, size=size) for size in SIZES[:2]}
    stats = kiln_stats(compiled)
    after_first_change = stats.compile_count
    images[SIZES[2]] = sample(compiled, size=SIZES[2])
    for size, image in images.items():
        assert psnr(image, sample(stock, size=size)) >= 40, (size, stats.summary())
    assert stats.compile_count == after_first_change, stats.summary()  # no recompile after the first size change
    assert stats.fallback is None and stats.eager_calls == 0, stats.summary()
    assert not stats.region_fallbacks, stats.region_fallbacks
    assert quantized_weights(stock) == held  # the weights stay ComfyUI's quantized tensors


@pytest.mark.slow
def test_a_lora_after_kiln_applies_to_comfyuis_quantized_weights(stock):
    compiled, _ = compile_unet(stock, mode="fast")
    patches = lora_like_patches(stock, scale=0.05)
    with_lora, eager_lora = compiled.clone(), stock.clone()
    with_lora.add_patches(patches, 1.0)
    eager_lora.add_patches(patches, 1.0)
    got, want, without = sample(with_lora, size=8), sample(eager_lora, size=8), sample(stock, size=8)
    assert rel_err(want, without) > 1e-3, "the LoRA changes nothing: the case tests nothing"
    assert psnr(got, want) >= 40
    assert kiln_stats(with_lora).eager_calls == 0


@pytest.mark.slow
def test_comfyuis_fp8_matmul_layers_compile_through_their_traceable_stand_in(float_unet, tmp_path, monkeypatch):
    """On a GPU with fp8 matmul (emulated here: ComfyUI's SUPPORT_FP8_OPS), ComfyUI's fp8 layers quantize their
    activations inside the layer. ComfyUI 0.33.0's make a QuantizedTensor that TorchDynamo cannot capture with
    dynamic sizes ("Expect size to be a plain tuple of ints"): every block region holding one ran eagerly (11 of
    13 on the tiny SD1.5). Kiln's nodes now give the compiler a traceable stand-in for those layers
    (nodes/comfy_layers.py): every region compiles, none is kept eager, and the image is the eager one."""
    import comfy.model_management

    import kiln.compiler
    from kiln.nodes import comfy_layers

    traced = []
    real = kiln.compiler.tensorwise_fp8_linear  # what nodes/comfy_layers.py calls

    def counted(*args, **kwargs):
        traced.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kiln.compiler, "tensorwise_fp8_linear", counted)
    monkeypatch.setattr(comfy.model_management, "SUPPORT_FP8_OPS", True)
    path = tmp_path / "unet_fp8_compute.safetensors"
    safetensors.torch.save_file(comfy_quantized(float_unet, "float8_e4m3fn"), str(path))
    with torch.inference_mode():
        stock = comfy.sd.load_diffusion_model(str(path))
        fp8_layers = [m for m in stock.model.diffusion_model.modules()
                      if getattr(m, "layout_type", None) in comfy_layers.FP8_LAYOUTS]
        assert fp8_layers, "ComfyUI loaded no fp8 matmul layer: the case tests nothing"
        compiled, _ = KilnCompileUNet().compile(stock)
        got, want = sample(compiled, size=8), sample(stock, size=8)
    assert psnr(got, want) >= 40
    stats = kiln_stats(compiled)
    assert stats.eager_calls == 0, stats.summary()
    assert not stats.region_fallbacks, stats.summary()  # no region kept eager for the layout
    assert traced, "no fp8 layer went through the stand-in"
    assert all("forward" not in m.__dict__ for m in fp8_layers)  # outside Kiln's call, ComfyUI's own layers
