import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing.models import MODELS
from kiln.compiler.passes import fuse_adaln_modulation as pass_module
from kiln.compiler.passes.base import PassContext, PassResult, kernel_gate
from testing_utils import rel_err

ON = kiln.CompileOptions(mode="fast", passes={"fuse_adaln_modulation": "on"})


def test_replacement_equals_pattern():
    x, scale, shift = pass_module.example_inputs()
    ref = pass_module.pattern_adaln_modulation(x, scale, shift)
    assert rel_err(pass_module.replacement_adaln_modulation(x, scale, shift), ref) < 1e-6


class AdaLN(torch.nn.Module):
    """A DiT block's norm + modulation, spelled as diffusers and ComfyUI spell it."""

    def __init__(self, dim=24, style="diffusers", affine=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=affine, eps=1e-6)
        self.emb = torch.nn.Linear(8, 2 * dim)
        self.style = style

    def forward(self, x, cond):
        shift, scale = self.emb(F.silu(cond)).chunk(2, dim=-1)      # (B, C) each
        if self.style == "diffusers":                                # AdaLayerNormZero
            return self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        if self.style == "continuous":                               # AdaLayerNormContinuous
            return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
        if self.style == "comfy_mmdit":                              # ComfyUI's SD3 modulate, operands swapped
            return shift.unsqueeze(1) + (1 + scale.unsqueeze(1)) * self.norm(x)
        if self.style == "comfy_flux":                               # ComfyUI's Flux apply_mod
            return torch.addcmul(shift[:, None], self.norm(x), 1 + scale[:, None])
        if self.style == "per_token":                                # not AdaLN: the pass must not fire
            return self.norm(x) * (1 + x) + shift[:, None]
        raise ValueError(self.style)


class NormUsedTwice(torch.nn.Module):
    def forward(self, x, scale):
        n = F.layer_norm(x, (x.shape[-1],))
        return n * scale + 1.0 + n.sum()


@pytest.mark.parametrize("module, expected", [
    (AdaLN(style="diffusers"), 1), (AdaLN(style="continuous"), 1), (AdaLN(style="comfy_mmdit"), 1),
    (AdaLN(style="comfy_flux"), 1),
    (AdaLN(style="diffusers", affine=True), 1), (AdaLN(style="per_token"), 0),
])
def test_forced_on_in_fast_mode(module, expected):
    x, cond = torch.randn(2, 11, 24), torch.randn(2, 8)
    compiled = kiln.compile(module, options=ON)
    assert rel_err(compiled(x, cond), module(x, cond)) < 1e-5
    info = kiln.stats(compiled)
    assert info.pass_counts["fuse_adaln_modulation"] == expected
    if not expected:
        assert "not per sample and channel" in info.compiles[0].skipped["fuse_adaln_modulation"][0]


def test_a_norm_with_other_users_is_left_alone():
    module, x, scale = NormUsedTwice(), torch.randn(2, 5, 12), torch.randn(2, 1, 12)
    compiled = kiln.compile(module, options=ON)
    assert rel_err(compiled(x, scale), module(x, scale)) < 1e-5
    assert kiln.stats(compiled).pass_counts["fuse_adaln_modulation"] == 0


def test_one_graph_for_every_batch_with_the_kernel_in_it():
    """The batch is symbolic in the captured graph; the shape check must not specialise it."""
    module = AdaLN()
    compiled = kiln.compile(module, options=ON)
    for batch in (2, 3, 5):
        x, cond = torch.randn(batch, 7, 24), torch.randn(batch, 8)
        assert rel_err(compiled(x, cond), module(x, cond)) < 1e-5
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and info.pass_counts["fuse_adaln_modulation"] == 1


def test_auto_serves_mode_fast_only_and_says_why():
    on_gpu = dict(device_type="cuda", triton=True)
    assert kernel_gate(PassContext(mode="fast", inductor=False, **on_gpu), PassResult("x"), "LayerNorm+modulation", without_inductor_only=True)
    result = PassResult("fuse_adaln_modulation")
    assert not kernel_gate(PassContext(mode="balanced", **on_gpu), result, "LayerNorm+modulation", without_inductor_only=True)
    assert "in mode balanced Inductor fuses this" in result.skipped[0]
    assert kernel_gate(PassContext(mode="max", switch="on", **on_gpu), PassResult("x"), "x", without_inductor_only=True)


def test_auto_on_cpu_leaves_it_and_says_why():
    module, x, cond = AdaLN(), torch.randn(2, 3, 24), torch.randn(2, 8)
    compiled = kiln.compile(module, mode="fast")
    compiled(x, cond)
    info = kiln.stats(compiled)
    assert info.pass_counts["fuse_adaln_modulation"] == 0
    assert "cpu has no Triton kernel here" in info.compiles[0].skipped["fuse_adaln_modulation"][0]


def _count(module, type_name):
    return sum(1 for m in module.modules() if type(m).__name__ == type_name)


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_dit_norms_are_fused(name):
    """Every AdaLN modulation of diffusers' Flux and SD3 transformers: each double/joint block
    modulates its image and text streams before attention and before the feed-forward, a single
    block once, the output norm once."""
    spec = MODELS[name]
    dit = spec.build("tiny")
    args, kwargs = spec.inputs(dit, batch=2)
    compiled = kiln.compile(dit, options=ON.replace(compile_unit="whole"))  # every norm in one graph
    assert rel_err(compiled(*args, **kwargs)[0], dit(*args, **kwargs)[0]) < 1e-5
    if name == "flux":
        expected = 4 * _count(dit, "FluxTransformerBlock") + _count(dit, "FluxSingleTransformerBlock") + 1
    else:  # the last joint block only reads the text stream (context_pre_only): norm1_context, no norm2_context
        expected = 4 * _count(dit, "JointTransformerBlock") - 1 + 1
    assert kiln.stats(compiled).pass_counts["fuse_adaln_modulation"] == expected
