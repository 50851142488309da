"""Compiling a method that is not forward (a VAE's decode): the compiled method matches eager, is made
once per module and method, and keeps working while the instance has a patched attribute of that name
(ComfyUI's object patches install the compiled function there)."""
import pytest
import torch

from kiln.compiler import CompileOptions, KilnPlan, method_module, model_for


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):  # never what is compiled here
        raise AssertionError("forward is not the method compiled")

    def decode(self, z):
        return torch.nn.functional.interpolate(self.conv(z), scale_factor=2.0, mode="nearest").tanh()


def test_a_compiled_method_matches_eager_and_survives_an_instance_patch_of_its_name():
    torch.manual_seed(0)
    model = TinyDecoder()
    compiled = model_for(method_module(model, "decode"), KilnPlan(compile=CompileOptions(mode="fast")))
    z = torch.randn(1, 4, 5, 7)
    expected = model.decode(z)
    model.decode = lambda *a, **k: compiled(*a, **k)  # what an object patch does
    with torch.no_grad():
        got = model.decode(z)
        other = model.decode(torch.randn(1, 4, 6, 9))  # another size: dynamic from the first compile
    assert torch.allclose(got, expected, atol=1e-5)
    assert other.shape == (1, 3, 12, 18)
    assert compiled.stats.compile_count == 1 and compiled.stats.fallback is None
    assert compiled.stats.compiles[0].reason == "first compile"
    assert method_module(model, "decode") is compiled.original
    assert method_module(model, "decode").kiln_label == "TinyDecoder.decode"


def test_a_missing_method_is_named():
    with pytest.raises(AttributeError, match="TinyDecoder has no method 'encode'"):
        method_module(TinyDecoder(), "encode")
