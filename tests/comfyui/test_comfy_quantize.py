"""Kiln › Quantize Model, Save and Load on ComfyUI's own classes: ComfyUI's UNetModel in a
ModelPatcher, sampled by ComfyUI's KSampler path, saved and loaded by ComfyUI's own loader.
Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import json
import os

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")

import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
import folder_paths  # noqa: E402
import safetensors.torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from comfy_testing import DETECTABLE_SD15, comfy_quantized, compile_unet, lora_like_patches, make_tiny_sd15_patcher, sample  # noqa: E402
from kiln.compiler.quantize import SCHEMES, QuantizeError, QuantLinear, quantized_layers  # noqa: E402
from kiln.nodes.plan_wrapper import PLAN_KEY, comfyui_version  # noqa: E402
from kiln.nodes.quant_patcher import comfyui_quant_formats  # noqa: E402
from kiln.nodes.quantize_model import KilnLoadQuantizedModel, KilnQuantizeModel, KilnSaveQuantizedModel  # noqa: E402
from testing_utils import rel_err  # noqa: E402

ALL_LAYERS = "min_params: 0"  # the tiny UNet's layers are all under the default size threshold
# Sampled latent against the fp32 eager model's after 2 steps, policy ALL_LAYERS (max error relative to the
# max magnitude; the latent is mostly noise at 2 steps). Measured: 1.6e-4, 1.5e-4, 0.7e-4; bounds ~6x that.
BOUND = {"int8_weight": 1e-3, "int8_dynamic": 1e-3, "fp8_e4m3": 1e-3, "int8_tensorwise": 1e-3}
# The change a weight patch makes after quantization against the change it makes in eager, bounded per scheme;
# fp8_e4m3's bound is wider because its activations are quantized per row as on the GPU (W8A8): the rounding
# of the activations, different in the two runs, does not cancel in their difference
LORA_BOUND = {"int8_weight": 0.06, "fp8_e4m3": 0.3}
# Stock ComfyUI runs Kiln's fp8 file with Kiln's very weights (checked exactly), but its own layers: Kiln's
# fp8_e4m3 also rounds the activations to fp8 per row (W8A8), so the two samples may differ by that rounding,
# which this bounds (max error relative to the max magnitude, as BOUND)
STOCK_FP8_BOUND = 0.05


@pytest.fixture(scope="module")
def base():
    return make_tiny_sd15_patcher()


@pytest.fixture(scope="module")
def eager(base):
    return sample(base)


@pytest.fixture(scope="module")
def quantized(base):
    return {scheme: KilnQuantizeModel().quantize(base, scheme, policy=ALL_LAYERS) for scheme in BOUND}


@pytest.fixture(scope="module")
def detectable_float():
    """A float UNet ComfyUI's loader recognises (SD1.5 layout, 2 levels)."""
    return make_tiny_sd15_patcher(unet_config=DETECTABLE_SD15)


@pytest.fixture(scope="module")
def detectable(detectable_float):
    """detectable_float quantized under the default policy."""
    return {scheme: KilnQuantizeModel().quantize(detectable_float, scheme)[0]
            for scheme in ("int8_weight", "fp8_e4m3", "int8_tensorwise")}


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models", ([str(tmp_path)], {".safetensors"}))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    return tmp_path


@pytest.mark.parametrize("scheme", list(BOUND))
def test_quantized_sampling_is_close_to_eager(quantized, eager, scheme):
    model, report = quantized[scheme]
    layers = quantized_layers(model.model.diffusion_model)
    assert layers and all(layer.scheme_name == scheme for layer in layers.values())
    assert "layers quantized" in report and "kept in high precision" in report
    assert rel_err(sample(model), eager) < BOUND[scheme]


def test_the_model_given_is_untouched(base, quantized):
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    KilnQuantizeModel().quantize(base, "int8_dynamic", policy=ALL_LAYERS)
    assert not quantized_layers(base.model.diffusion_model)
    after = base.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    model, _ = quantized["int8_weight"]
    assert model.model is not base.model and model.model.diffusion_model is not base.model.diffusion_model


def test_quantized_weights_take_the_quantized_size(base, quantized):
    model, _ = quantized["int8_weight"]
    assert model.model_size() < 0.5 * base.model_size()  # fp32 weights here: int8 is about a quarter


def test_lora_before_the_node_is_baked_in(base):
    lora = base.clone()
    lora.add_patches(lora_like_patches(base))
    with_lora = sample(lora)
    model, report = KilnQuantizeModel().quantize(lora, "int8_weight", policy=ALL_LAYERS)
    assert "weight patches made before this node" in report
    assert rel_err(sample(model), with_lora) < BOUND["int8_weight"]


def test_another_branchs_lora_left_applied_is_not_baked_in(base, eager):
    """ComfyUI leaves the last prompt's patches on the shared module: quantizing the plain MODEL
    afterwards must read the plain weights."""
    other = base.clone()
    other.add_patches(lora_like_patches(base))
    sample(other)  # leaves the other branch's LoRA applied to the shared UNet
    model, _ = KilnQuantizeModel().quantize(base, "int8_weight", policy=ALL_LAYERS)
    assert rel_err(sample(model), eager) < BOUND["int8_weight"]


@pytest.mark.parametrize("scheme", ["int8_weight", "fp8_e4m3"])
def test_lora_after_the_node_changes_the_output_as_in_eager(base, eager, quantized, scheme):
    model, _ = quantized[scheme]
    plain = sample(model)
    # a patch that stays inside the range each layer was quantized for: every attention projection scaled by 0.7
    sd = base.model.state_dict()
    patches = {k: (-0.3 * sd[k],) for k in sd if k.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight"))}
    eager_lora, quant_lora = base.clone(), model.clone()
    eager_lora.add_patches(patches)
    assert len(quant_lora.add_patches(patches)) == len(patches)  # every key found: none dropped
    eager_delta = sample(eager_lora) - eager
    quant_delta = sample(quant_lora) - plain
    assert eager_delta.abs().max() > 0.05  # the LoRA changes the image
    assert rel_err(quant_delta, eager_delta) < LORA_BOUND[scheme]
    assert torch.equal(sample(model), plain)  # ComfyUI's unpatch restored the exact quantized weights


def test_quantize_then_compile_matches_quantize_eager(quantized):
    model, _ = quantized["int8_dynamic"]
    plain = sample(model)
    compiled, report = compile_unet(model, mode="fast")
    assert "quantize (int8_dynamic), then compile" in report
    torch.testing.assert_close(sample(compiled), plain, atol=1e-4, rtol=1e-4)
    assert rel_err(sample(compiled, batch=2, size=24), sample(model, batch=2, size=24)) < 1e-4


def test_compile_then_quantize_keeps_the_compile_in_the_plan(base):
    compiled, _ = compile_unet(base, mode="fast")
    model, _ = KilnQuantizeModel().quantize(compiled, "int8_weight", policy=ALL_LAYERS)
    plan = model.model_options[PLAN_KEY]
    assert plan.quantize.scheme == "int8_weight" and plan.compile.mode == "fast"


def test_calibration_keeps_layers_above_the_threshold(base):
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    positive = [[torch.randn(1, 7, 32), {}]]
    _, strict = KilnQuantizeModel().quantize(base, "fp8_e4m3", ALL_LAYERS, 2, 0.001, positive, latent)
    _, loose = KilnQuantizeModel().quantize(base, "fp8_e4m3", ALL_LAYERS, 2, 0.5, positive, latent)
    assert "calibration error > 0.001" in strict and "calibration error" not in loose
    assert "model output error on" in loose


@pytest.mark.parametrize("scheme", ["int8_weight", "fp8_e4m3", "int8_tensorwise"])
def test_save_then_load_gives_identical_outputs(detectable, models_dir, scheme):
    model = detectable[scheme]
    KilnSaveQuantizedModel().save(model, f"kiln/{scheme}")
    with pytest.raises(FileExistsError):
        KilnSaveQuantizedModel().save(model, f"kiln/{scheme}")
    loaded, report = KilnLoadQuantizedModel().load(f"kiln/{scheme}.safetensors")
    assert "quantized layers" in report
    assert torch.equal(sample(loaded, size=8), sample(model, size=8))


def test_kiln_fp8_file_is_comfyuis_format_and_loads_in_stock_comfyui(detectable, models_dir):
    model = detectable["fp8_e4m3"]
    KilnSaveQuantizedModel().save(model, "fp8")
    path = str(models_dir / "fp8.safetensors")
    name = next(n for n, m in model.model.diffusion_model.named_modules() if isinstance(m, QuantLinear))
    with safe_open(path, "pt") as f:
        assert f.get_tensor(f"{name}.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor(f"{name}.weight_scale").dtype == torch.float32
        marker = f.get_tensor(f"{name}.comfy_quant")
        assert json.loads(bytes(marker.tolist())) == {"format": "float8_e4m3fn"}
    stock = comfy.sd.load_diffusion_model(path)  # ComfyUI's own Load Diffusion Model path, no Kiln
    assert not quantized_layers(stock.model.diffusion_model)
    stock_layers = dict(stock.model.diffusion_model.named_modules())
    for name, layer in quantized_layers(model.model.diffusion_model).items():  # the very weights Kiln runs
        assert torch.equal(stock_layers[name].weight.float(), layer.dequantized_weight()), name
    assert rel_err(sample(stock, size=8), sample(model, size=8)) < STOCK_FP8_BOUND


@pytest.mark.parametrize("layout", ["comfy_quant", "scaled_fp8"])
def test_a_comfyui_fp8_file_loads_in_kiln(detectable, models_dir, layout):
    """ComfyUI's own fp8 layouts: the per-layer comfy_quant format (written here from a model stock
    ComfyUI loaded) and the older checkpoint-wide "scaled_fp8" format ComfyUI still reads."""
    model = detectable["fp8_e4m3"]
    KilnSaveQuantizedModel().save(model, "fp8")
    stock = comfy.sd.load_diffusion_model(str(models_dir / "fp8.safetensors"))
    sd = {k: getattr(v, "_qdata", v) for k, v in stock.model.diffusion_model.state_dict().items()}
    if layout == "scaled_fp8":
        sd = {(k[:-len("weight_scale")] + "scale_weight" if k.endswith(".weight_scale") else k): v
              for k, v in sd.items() if not k.endswith(".comfy_quant")}
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    comfy.utils.save_torch_file(sd, str(models_dir / "comfy_fp8.safetensors"))
    loaded, _ = KilnLoadQuantizedModel().load("comfy_fp8.safetensors")
    assert len(quantized_layers(loaded.model.diffusion_model)) == len(quantized_layers(model.model.diffusion_model))
    assert torch.equal(sample(loaded, size=8), sample(model, size=8))


# ---- ComfyUI's int8_tensorwise, and formats only ComfyUI reads -----------------------------------

# Kiln's weight-only int8 against stock ComfyUI's int8 GEMM, which quantizes activations per row too (W8A8):
# sampled latents on the detectable UNet, measured 6.3e-3 to 7.3e-3 (Kiln against the float model: 4.0e-3)
INT8_STOCK_BOUND = 0.02


def comfy_format_file(patcher, path, file_format: str, per_row: bool = False, stored=None) -> int:
    """Write `patcher`'s float diffusion model in ComfyUI's `file_format` (comfy_testing.comfy_quantized); returns
    how many layers."""
    sd = comfy_quantized(patcher.model.diffusion_model.state_dict(), file_format, per_row, stored)
    comfy.utils.save_torch_file(sd, str(path))
    return sum(key.endswith(".comfy_quant") for key in sd)


def comfy_quantized_weights(model) -> list:
    import comfy.quant_ops

    return [p for p in model.model.diffusion_model.parameters() if isinstance(p, comfy.quant_ops.QuantizedTensor)]


def test_kiln_int8_tensorwise_file_is_comfyuis_format_and_loads_in_stock_comfyui(detectable, models_dir):
    if "int8_tensorwise" not in comfyui_quant_formats():
        pytest.skip(f"ComfyUI {comfyui_version()} has no int8_tensorwise in comfy.quant_ops.QUANT_ALGOS (0.33.0 has)")
    model = detectable["int8_tensorwise"]
    KilnSaveQuantizedModel().save(model, "int8")
    path = str(models_dir / "int8.safetensors")
    linears = [n for n, m in model.model.diffusion_model.named_modules() if isinstance(m, QuantLinear)]
    with safe_open(path, "pt") as f:
        assert f.get_tensor(f"{linears[0]}.weight").dtype == torch.int8
        assert f.get_tensor(f"{linears[0]}.weight_scale").shape == ()
        assert not [k for k in f.keys() if k.endswith(".kiln_quant")]
    stock = comfy.sd.load_diffusion_model(path)  # ComfyUI's own Load Diffusion Model path, no Kiln
    weights = comfy_quantized_weights(stock)
    assert len(weights) == len(linears) and {w._layout_cls for w in weights} == {"TensorWiseINT8Layout"}
    assert not quantized_layers(stock.model.diffusion_model)
    # ComfyUI's int8 GEMM (comfy_kitchen int8_linear) also quantizes activations per row; Kiln's is weight-only
    assert rel_err(sample(stock, size=8), sample(model, size=8)) < INT8_STOCK_BOUND


def test_the_save_report_says_which_readers_load_the_file(detectable, models_dir):
    for scheme in ("int8_weight", "fp8_e4m3", "int8_tensorwise"):
        shown = KilnSaveQuantizedModel().save(detectable[scheme], scheme)["ui"]["text"]
        assert shown == [str(models_dir / f"{scheme}.safetensors"), f"the file loads in: {SCHEMES[scheme].readers}"]


@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-row"])
def test_a_comfyui_int8_tensorwise_file_loads_in_kiln(detectable_float, models_dir, per_row):
    """Written in ComfyUI's own layout from the float model: Kiln reads it on any ComfyUI (0.8.0 too), per
    tensor as int8_tensorwise, per row as Kiln's per-channel int8_weight, the same image as Kiln's own
    quantization of every Linear layer; where this ComfyUI has the format, its own loader gives a close one."""
    layers = comfy_format_file(detectable_float, models_dir / "comfy_int8.safetensors", "int8_tensorwise", per_row)
    loaded, report = KilnLoadQuantizedModel().load("comfy_int8.safetensors")
    kiln_layers = quantized_layers(loaded.model.diffusion_model)
    scheme = "int8_weight" if per_row else "int8_tensorwise"
    assert len(kiln_layers) == layers and f"with {layers} quantized layers" in report
    assert {m.scheme_name for m in kiln_layers.values()} == {scheme}
    every_linear = "min_params: 0\nconvs: false\nquantize: ['time_embed.*']"  # over the family's defaults
    kilns_own, _ = KilnQuantizeModel().quantize(detectable_float, scheme, policy=every_linear)
    assert quantized_layers(kilns_own.model.diffusion_model).keys() == kiln_layers.keys()
    image = sample(loaded, size=8)
    assert torch.equal(image, sample(kilns_own, size=8))
    if "int8_tensorwise" in comfyui_quant_formats():
        stock = comfy.sd.load_diffusion_model(str(models_dir / "comfy_int8.safetensors"))
        assert len(comfy_quantized_weights(stock)) == layers
        assert rel_err(image, sample(stock, size=8)) < INT8_STOCK_BOUND


def test_a_float8_e5m2_file_goes_to_comfyuis_own_loader(detectable_float, models_dir):
    """Kiln does not read float8_e5m2; every ComfyUI Kiln is tested on does, so its own loader loads the file."""
    if "float8_e5m2" not in comfyui_quant_formats():
        pytest.skip(f"ComfyUI {comfyui_version()} has no float8_e5m2 in comfy.quant_ops.QUANT_ALGOS")
    layers = comfy_format_file(detectable_float, models_dir / "e5m2.safetensors", "float8_e5m2")
    model, report = KilnLoadQuantizedModel().load("e5m2.safetensors")
    assert report == (f"Kiln: e5m2.safetensors has layers in 'float8_e5m2', which Kiln's quantized layers do not read, "
                      f"so ComfyUI {comfyui_version()}'s own loader loaded it (quantized layers: {layers} 'float8_e5m2'; "
                      f"ComfyUI's quantized weights, not Kiln's). Kiln › Compile UNet still applies to this model.")
    assert not quantized_layers(model.model.diffusion_model) and len(comfy_quantized_weights(model)) == layers
    assert rel_err(sample(model, size=8), sample(detectable_float, size=8)) < 0.1  # 2 mantissa bits; measured 0.038


def test_a_file_in_a_format_neither_reads_is_refused_naming_the_layer_and_the_comfyui(detectable_float, models_dir):
    comfy_format_file(detectable_float, models_dir / "fp4.safetensors", "float4_unknown",
                      stored=(torch.int8, 7.0))  # a format neither Kiln nor any ComfyUI reads
    with pytest.raises(QuantizeError) as caught:
        KilnLoadQuantizedModel().load("fp4.safetensors")
    message = str(caught.value)
    assert message.startswith(f"{models_dir / 'fp4.safetensors'}: layer ") and "quantized as 'float4_unknown', which " \
        "neither Kiln" in message and f"nor this ComfyUI {comfyui_version()} (its quantized formats: " in message, message


def test_save_refuses_a_model_that_is_not_quantized(base, models_dir):
    with pytest.raises(ValueError, match="no Kiln-quantized layers"):
        KilnSaveQuantizedModel().save(base, "plain")


def test_filename_cannot_leave_the_folder(quantized, models_dir):
    with pytest.raises(ValueError, match="leaves the diffusion_models folder"):
        KilnSaveQuantizedModel().save(quantized["int8_weight"][0], "../escape")



def test_a_damaged_file_is_refused_naming_the_file_and_the_layer(detectable, models_dir):
    """An int8 weight rewritten as float32 (before: cast back silently, outputs 250x off)."""
    KilnSaveQuantizedModel().save(detectable["int8_weight"], "damaged")
    path = str(models_dir / "damaged.safetensors")
    with safe_open(path, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    layer = next(k[:-len(".kiln_quant")] for k in tensors if k.endswith(".kiln_quant"))
    tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"].float()
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    with pytest.raises(QuantizeError) as caught:
        KilnLoadQuantizedModel().load("damaged.safetensors")
    message = str(caught.value)
    assert message.startswith(f"{path}: layer {layer}'s weight is stored as torch.float32"), message


def test_a_failed_save_with_overwrite_leaves_the_old_file(detectable, models_dir, monkeypatch):
    """Before: the file was written in place, so a failure half way (a full disk) destroyed it."""
    KilnSaveQuantizedModel().save(detectable["int8_weight"], "kept")
    path = models_dir / "kept.safetensors"
    before = path.read_bytes()

    def half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(before[:len(before) // 2])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        KilnSaveQuantizedModel().save(detectable["fp8_e4m3"], "kept", overwrite=True)
    assert path.read_bytes() == before and os.listdir(models_dir) == ["kept.safetensors"]
    assert folder_paths.get_filename_list("diffusion_models") == ["kept.safetensors"]
