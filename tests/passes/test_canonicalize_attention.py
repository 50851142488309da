import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.compiler.passes import canonicalize_attention as pass_module
from kiln.testing.models import MODELS
from testing_utils import rel_err


def test_replacement_equals_pattern():
    q, k, v = pass_module.example_inputs()
    ref = pass_module.pattern_attention(q, k, v)
    assert rel_err(pass_module.replacement_attention(q, k, v), ref) < 1e-6


class Baddbmm(torch.nn.Module):  # diffusers' AttnProcessor (get_attention_scores), upcast softmax
    def forward(self, q, k, v):
        empty = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=0.3)
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        return torch.bmm(probs, v)


class Matmul(torch.nn.Module):  # hand-written, scale applied after the product, 4-D heads
    def forward(self, q, k, v):
        return F.softmax((q @ k.transpose(-2, -1)) / 3.0, dim=-1) @ v


class Einsum(torch.nn.Module):  # ComfyUI's attention_basic
    def forward(self, q, k, v):
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * q.shape[-1] ** -0.5
        return torch.einsum("b i j, b j d -> b i d", sim.softmax(dim=-1), v)


class Masked(torch.nn.Module):  # an additive mask is not matched: the pass must leave it alone
    def forward(self, q, k, v):
        return ((q @ k.transpose(-1, -2)) * 0.5 + 1.0).softmax(dim=-1) @ v


@pytest.mark.parametrize("module, shapes, expected", [
    (Baddbmm(), [(6, 11, 8), (6, 13, 8), (6, 13, 5)], 1),
    (Matmul(), [(2, 3, 11, 8), (2, 3, 13, 8), (2, 3, 13, 8)], 1),
    (Einsum(), [(6, 11, 8), (6, 13, 8), (6, 13, 8)], 1),
    (Masked(), [(6, 11, 8), (6, 13, 8), (6, 13, 8)], 0),
])
def test_spellings_of_attention(module, shapes, expected):
    q, k, v = (torch.randn(s) for s in shapes)
    compiled = kiln.compile(module, mode="fast")
    out = compiled(q, k, v)
    assert rel_err(out, module(q, k, v)) < 1e-5
    assert kiln.stats(compiled).pass_counts["canonicalize_attention"] == expected


def test_diffusers_attn_processor_unet_is_canonicalized():
    from diffusers.models.attention_processor import AttnProcessor

    spec = MODELS["sd15"]
    unet = spec.build("tiny")
    unet.set_attn_processor(AttnProcessor())  # the classic baddbmm/softmax/bmm processor
    args, kwargs = spec.inputs(unet, batch=2)
    compiled = kiln.compile(unet, options=kiln.CompileOptions(mode="fast", compile_unit="whole"))
    out = compiled(*args, **kwargs)[0]
    assert rel_err(out, unet(*args, **kwargs)[0]) < 1e-5
    # tiny SD1.5: 4 transformer blocks (down 1, mid 1, up 2) x (self + cross attention)
    assert kiln.stats(compiled).pass_counts["canonicalize_attention"] == 8


def test_switched_off():
    q, k, v = (torch.randn(2, 5, 4) for _ in range(3))
    compiled = kiln.compile(Matmul(), options=kiln.CompileOptions(mode="fast", passes={"canonicalize_attention": "off"}))
    compiled(q, k, v)
    assert kiln.stats(compiled).pass_counts["canonicalize_attention"] == 0
