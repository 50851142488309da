"""Quantized layers on their own: shapes, dtype casts, devices, weight patching and clipping."""
import logging

import pytest
import torch

from kiln.compiler.quantize import SCHEMES, QuantConv2d, QuantLinear


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_linear_matches_its_dequantized_weight(scheme):
    torch.manual_seed(0)
    dense = torch.nn.Linear(45, 29)
    layer = QuantLinear.from_float(dense, SCHEMES[scheme])
    x = torch.randn(3, 7, 45)
    out = layer(x)
    assert out.shape == (3, 7, 29) and out.dtype == x.dtype
    ref = torch.nn.functional.linear(x, layer.dequantized_weight(), dense.bias)
    # activations quantized per row too (int8: 1/254 of a row's range; e4m3: 3 mantissa bits)
    tolerance = {"int8_dynamic": 0.02, "fp8_e4m3": 0.06}.get(scheme, 1e-5)
    assert ((out - ref).norm() / ref.norm()).item() < tolerance


def test_conv_is_weight_only():
    torch.manual_seed(0)
    dense = torch.nn.Conv2d(5, 7, 3, padding=1, stride=2)
    layer = QuantConv2d.from_float(dense, SCHEMES["int8_weight"])
    x = torch.randn(2, 5, 9, 11)
    ref = torch.nn.functional.conv2d(x, layer.dequantized_weight(), dense.bias, 2, 1)
    torch.testing.assert_close(layer(x), ref)


@pytest.mark.parametrize("kernel", [1, 3])
def test_conv_of_a_channels_last_model_answers_in_eagers_layout(kernel):
    """A conv's output takes its weight's memory format; quantizing loses a 1x1 kernel's (its strides
    are ambiguous), and a block fed another layout than in eager recompiles (seen on a GPU: SD1.5's
    1x1 proj_out, int8_dynamic, 11 recompiles)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, kernel, padding=kernel // 2).to(memory_format=torch.channels_last)
    layer = QuantConv2d.from_float(conv, SCHEMES["int8_weight"])
    x = torch.randn(2, 16, 5, 5)  # NCHW, as a transformer block's output before proj_out
    assert layer(x).stride() == conv(x).stride()
    plain = QuantConv2d.from_float(torch.nn.Conv2d(16, 16, kernel, padding=kernel // 2), SCHEMES["int8_weight"])
    assert plain.weight_strides is None and plain(x).stride() == x.stride()


def test_a_patch_beyond_the_quantized_range_is_clipped_and_said(caplog):
    layer = QuantLinear.from_float(torch.nn.Linear(8, 4), SCHEMES["int8_weight"])
    with caplog.at_level(logging.WARNING, logger="kiln"):
        layer.set_weight(layer.dequantized_weight() * 3, seed=0)
    assert "goes 3.00x beyond the range quantized for it" in caplog.text
    assert layer.weight.abs().max() == 127


def test_weights_on_another_device_are_copied_for_the_call(caplog):
    """What a partially loaded model looks like from the layer: weights and input on different devices."""
    layer = QuantLinear.from_float(torch.nn.Linear(8, 4), SCHEMES["int8_weight"])  # on the CPU
    with caplog.at_level(logging.WARNING, logger="kiln"):
        out = layer(torch.randn(2, 8, device="meta"))  # the input on another device (meta: shapes only)
    assert out.shape == (2, 4) and out.device.type == "meta" and "copied over on each call" in caplog.text
    assert layer.weight.device.type == "cpu"  # the layer itself stays where the host put it
