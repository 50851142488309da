"""kiln.quantize on tiny real architectures (diffusers' SD1.5 UNet and Flux transformer): error
against fp32 eager, the original untouched, the report, weight patching, calibration, compile."""
import pytest
import torch

import kiln
from kiln.testing.models import MODELS
from kiln.compiler.quantize import QuantConv2d, QuantizeError, QuantLinear, quantized_layers

ALL = "min_params: 0"  # tiny models: every layer is under the default size threshold
# Relative L2 error of the model's output against fp32 eager, policy ALL with the family defaults.
# Measured on these seeds, SD1.5 / Flux: int8_weight 0.0106 / 0.0005, int8_dynamic 0.0114 / 0.0011,
# fp8_e4m3 0.0097 / 0.0039, int8_tensorwise 0.0015 / 0.0005 (fp8_e4m3 and int8_tensorwise quantize Linear
# layers only). The bounds leave about 2x room.
BOUND = {"int8_weight": 0.025, "int8_dynamic": 0.025, "fp8_e4m3": 0.02, "int8_tensorwise": 0.005}


def rel_l2(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=["sd15", "flux"])
def model(request):
    spec = MODELS[request.param]
    module = spec.build("tiny")
    args, kwargs = spec.inputs(module, batch=2)
    return module, args, kwargs, module(*args, **kwargs)[0]


@pytest.mark.parametrize("scheme", list(BOUND))
def test_quantized_output_is_close_to_eager(model, scheme):
    module, args, kwargs, ref = model
    quantized = kiln.quantize(module, scheme, policy=ALL)
    layers = quantized_layers(quantized)
    assert layers and {type(m) for m in layers.values()} <= {QuantLinear, QuantConv2d}
    error = rel_l2(quantized(*args, **kwargs)[0], ref)
    assert error < BOUND[scheme], f"{scheme}: {error:.4f}"


def test_quantize_options_and_the_keyword_shorthand_quantize_alike(model):
    module, args, kwargs, _ = model
    options = kiln.QuantizeOptions("int8_weight", kiln.LayerPolicy(min_params=0, keep=("conv_in",)), error_threshold=0.1)
    by_options = kiln.quantize(module, options)
    by_keywords = kiln.quantize(module, "int8_weight", policy="min_params: 0\nkeep: [conv_in]", error_threshold=0.1)
    assert kiln.quant_report(by_options).as_dict() == kiln.quant_report(by_keywords).as_dict()
    assert torch.equal(by_options(*args, **kwargs)[0], by_keywords(*args, **kwargs)[0])
    with pytest.raises(kiln.QuantizeError, match="inside the QuantizeOptions"):
        kiln.quantize(module, options, policy=ALL)


def test_the_original_is_untouched(model):
    module, args, kwargs, ref = model
    before = {k: v.clone() for k, v in module.state_dict().items()}
    kiln.quantize(module, "int8_dynamic", policy=ALL)
    assert not quantized_layers(module)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert torch.equal(module(*args, **kwargs)[0], ref)


def test_kept_layers_are_copied_unless_shared(model):
    module = model[0]
    copied = kiln.quantize(module, "int8_weight", policy=ALL)
    shared = kiln.quantize(module, "int8_weight", policy=ALL, share_kept=True)
    name = next(iter(kiln.quant_report(copied).kept.values()))[0] + ".weight"  # a layer kept in high precision
    ptr = dict(module.named_parameters())[name].data_ptr()
    assert dict(copied.named_parameters())[name].data_ptr() != ptr
    assert dict(shared.named_parameters())[name].data_ptr() == ptr
    assert dict(shared.named_parameters())[name] is not dict(module.named_parameters())[name]


def test_report_says_what_was_done(model):
    module = model[0]
    quantized = kiln.quantize(module, "int8_weight", policy=ALL)
    report = kiln.quant_report(quantized)
    linears = [n for n, m in module.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert len(report.quantized) + report.kept_count == len(linears)
    assert any(reason in report.kept for reason in ("first layer", "last layer"))
    assert report.bytes_after < 0.5 * report.bytes_before  # fp32 -> int8 for most weights
    assert set(report.layer_error) == set(report.quantized) and max(report.layer_error.values()) < 0.01
    assert "layers quantized" in report.summary()


def test_default_policy_keeps_small_layers(model):
    quantized = kiln.quantize(model[0], "int8_weight")
    assert any(reason.startswith("small") for reason in kiln.quant_report(quantized).kept)


def test_weight_patch_through_convert_and_set_weight(model):
    """What ComfyUI's ModelPatcher does for LoRA on a quantized layer: dequantize, patch, store."""
    module, args, kwargs, _ = model
    quantized = kiln.quantize(module, "int8_weight", policy=ALL)
    name, layer = next((n, m) for n, m in quantized_layers(quantized).items() if isinstance(m, QuantLinear))
    before = layer.weight
    patched = layer.convert_weight(layer.weight.float()) * 0.5
    layer.set_weight(patched, seed=1)
    torch.testing.assert_close(layer.dequantized_weight(), patched, atol=layer.weight_scale.max().item(), rtol=0)
    assert layer.weight is not before and layer.weight.dtype == torch.int8


def test_calibration_measures_output_error_and_keeps_the_worst(model):
    module, args, kwargs, _ = model
    run = lambda: module(*args, **kwargs)  # noqa: E731
    loose = kiln.quant_report(kiln.quantize(module, "fp8_e4m3", policy=ALL, calibrate=run, error_threshold=0.5))
    assert loose.error_kind == "output (calibrated)" and loose.model_error is not None and loose.calibration_calls == 1
    worst = max(loose.layer_error, key=loose.layer_error.get)
    strict = kiln.quant_report(kiln.quantize(module, "fp8_e4m3", policy=ALL, calibrate=run,
                                             error_threshold=loose.layer_error[worst] * 0.99))
    assert worst in strict.kept["calibration error > %s" % (loose.layer_error[worst] * 0.99)]


def test_quantizing_twice_is_an_error(model):
    quantized = kiln.quantize(model[0], "int8_weight", policy=ALL)
    with pytest.raises(QuantizeError, match="already quantized"):
        kiln.quantize(quantized, "int8_weight")


def test_a_dtype_cast_keeps_the_stored_weights(model):
    quantized = kiln.quantize(model[0], "fp8_e4m3", policy=ALL)
    quantized.to(torch.bfloat16)
    layer = next(iter(quantized_layers(quantized).values()))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32


def test_quantize_then_compile_matches_quantize_eager():
    spec = MODELS["sd15"]
    module = spec.build("tiny")
    quantized = kiln.quantize(module, "int8_dynamic", policy=ALL)
    compiled = kiln.compile(quantized, mode="fast")
    for batch in (2, 3):
        args, kwargs = spec.inputs(module, batch=batch)
        torch.testing.assert_close(compiled(*args, **kwargs)[0], quantized(*args, **kwargs)[0], atol=1e-4, rtol=1e-4)
    stats = kiln.stats(compiled)
    assert stats.fallback is None and not stats.recompiles and stats.eager_calls == 0 and not stats.region_fallbacks


@pytest.mark.slow
def test_quantize_then_inductor_compile_matches_quantize_eager():
    spec = MODELS["flux"]
    module = spec.build("tiny")
    quantized = kiln.quantize(module, "int8_weight", policy=ALL)
    compiled = kiln.compile(quantized, mode="balanced")
    args, kwargs = spec.inputs(module, batch=2)
    torch.testing.assert_close(compiled(*args, **kwargs)[0], quantized(*args, **kwargs)[0], atol=1e-4, rtol=1e-4)
    assert kiln.stats(compiled).fallback is None
