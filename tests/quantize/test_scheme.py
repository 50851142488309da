"""The schemes' math: quantize, dequantize, fixed-scale requantization and stochastic rounding."""
import pytest
import torch

from kiln.compiler.quantize import SCHEMES, QuantizeError, scheme_named


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())).item()


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(37, 45) * torch.linspace(0.01, 2.0, 37)[:, None]  # channels of very different ranges


def test_int8_is_per_channel_and_within_half_a_step(weight):
    scheme = SCHEMES["int8_weight"]
    stored, scale = scheme.quantize(weight)
    assert stored.dtype == torch.int8 and scale.shape == (37,) and scale.dtype == torch.float32
    assert stored.abs().max() <= 127
    torch.testing.assert_close(scale, weight.abs().amax(1) / 127)
    error = (scheme.dequantize(stored, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()
    assert sqnr_db(weight, scheme.dequantize(stored, scale)) > 38


def test_fp8_is_comfyui_per_tensor_amax_over_448(weight):
    scheme = SCHEMES["fp8_e4m3"]
    stored, scale = scheme.quantize(weight)
    assert stored.dtype == torch.float8_e4m3fn and scale.dim() == 0
    torch.testing.assert_close(scale, weight.abs().max() / 448)
    deq = scheme.dequantize(stored, scale)
    normal = weight.abs() / scale > 2 ** -6
    assert ((deq - weight).abs()[normal] <= weight.abs()[normal] * 2 ** -4 + 1e-9).all()  # 3 mantissa bits
    assert sqnr_db(weight, deq) > 25


def test_int8_tensorwise_is_comfyuis_one_scale_amax_over_127(weight):
    """ComfyUI's int8_tensorwise (comfy_kitchen's quantize_int8_tensorwise): scale = amax / 127, one per tensor."""
    scheme = SCHEMES["int8_tensorwise"]
    stored, scale = scheme.quantize(weight)
    assert stored.dtype == torch.int8 and scale.shape == () and scale.dtype == torch.float32
    torch.testing.assert_close(scale, weight.abs().max() / 127)
    assert stored.abs().max() == 127
    deq = scheme.dequantize(stored, scale)
    assert ((deq - weight).abs() <= scale / 2 + 1e-7).all()
    torch.testing.assert_close(deq, stored.float() * scale)  # ComfyUI's dequantization: q.float() * scale
    assert sqnr_db(weight, deq) > 25  # one range for channels 200x apart: below per-channel int8's 38 dB


def test_int8_tensorwise_runs_the_weight_only_int8_gemm(weight):
    scheme = SCHEMES["int8_tensorwise"]
    assert (scheme.linear_op, scheme.per_channel, scheme.file_key) == ("int8_weight_linear", False, "comfy_quant")
    stored, scale = scheme.quantize(weight)
    x = torch.randn(3, 45)
    torch.testing.assert_close(scheme.linear()(x, stored, scale, None), x @ scheme.dequantize(stored, scale).t())


def test_each_scheme_says_what_reads_its_files():
    readers = {name: scheme.readers for name, scheme in SCHEMES.items()}
    assert readers == {
        "int8_weight": "Kiln only (Kiln's own per-channel format)",
        "int8_dynamic": "Kiln only (Kiln's own per-channel format)",
        "fp8_e4m3": "ComfyUI 0.8.0 and newer (stock loader) and Kiln",
        "int8_tensorwise": "ComfyUI with int8_tensorwise (0.33.0 has it; 0.8.0 does not) and Kiln"}
    assert [n for n, s in SCHEMES.items() if s.comfyui_format] == ["fp8_e4m3", "int8_tensorwise"]


def test_int8_dynamic_stores_like_int8_weight(weight):
    a, b = SCHEMES["int8_dynamic"].quantize(weight), SCHEMES["int8_weight"].quantize(weight)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_zero_channel_quantizes_to_zero():
    stored, scale = SCHEMES["int8_weight"].quantize(torch.zeros(3, 5))
    assert (stored == 0).all() and (scale > 0).all()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_fixed_scale_requantization_keeps_the_scale(name, weight):
    scheme = SCHEMES[name]
    stored, scale = scheme.quantize(weight)
    again, same_scale = scheme.quantize(scheme.dequantize(stored, scale), scale)
    assert same_scale is not None and torch.equal(same_scale, scale)
    assert torch.equal(again.view(torch.uint8) if again.dtype != torch.int8 else again,
                       stored.view(torch.uint8) if stored.dtype != torch.int8 else stored)


@pytest.mark.parametrize("name", ["int8_weight", "fp8_e4m3", "int8_tensorwise"])
def test_stochastic_rounding_keeps_a_sub_step_patch_on_average(name, weight):
    """A LoRA delta of a tenth of a step vanishes with nearest rounding, and survives on average with
    the patcher's seed (stochastic rounding)."""
    scheme = SCHEMES[name]
    stored, scale = scheme.quantize(weight)
    base = scheme.dequantize(stored, scale)
    if scheme.storage == torch.int8:  # one step is the scale, per channel or per tensor
        step = scale.reshape(-1, 1)
    else:  # e4m3: 3 mantissa bits
        step = scale * 2.0 ** (torch.floor(torch.log2((base / scale).abs().clamp_min(2 ** -6))) - 3)
    delta = (0.1 * step).expand_as(base)
    nearest = scheme.dequantize(scheme.quantize(base + delta, scale)[0], scale)
    assert torch.equal(nearest, base)
    mean = torch.stack([scheme.dequantize(scheme.quantize(base + delta, scale, seed=s)[0], scale)
                        for s in range(200)]).mean(0)
    measured = (mean - base).sum() / delta.sum()
    assert 0.8 < measured.item() < 1.2


def test_unknown_scheme_names_the_choices():
    with pytest.raises(QuantizeError, match="int8_weight, int8_dynamic, fp8_e4m3"):
        scheme_named("int4")
