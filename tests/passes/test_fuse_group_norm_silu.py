import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing.models import MODELS
from kiln.compiler.passes import fuse_group_norm_silu as pass_module
from testing_utils import rel_err

ON = kiln.CompileOptions(mode="fast", passes={"fuse_group_norm_silu": "on"})


def test_replacement_equals_pattern():
    x, w, b = pass_module.example_inputs()
    ref = pass_module.pattern_group_norm_silu(x, w, b)
    assert rel_err(pass_module.replacement_group_norm_silu(x, w, b), ref) < 1e-6


class NormAct(torch.nn.Module):  # a ResBlock's in_layers: GroupNorm -> SiLU -> conv
    def __init__(self, channels=12, groups=3, affine=True):
        super().__init__()
        self.norm = torch.nn.GroupNorm(groups, channels, affine=affine)
        self.act = torch.nn.SiLU()
        self.conv = torch.nn.Conv2d(channels, 5, 3, padding=1)

    def forward(self, x):
        return self.conv(self.act(self.norm(x)))


class NormReused(torch.nn.Module):  # the normalised tensor is needed on its own: not fusable
    def forward(self, x):
        h = F.group_norm(x, 3)
        return F.silu(h) + h


@pytest.mark.parametrize("module, channels_last, expected", [
    (NormAct(), False, 1), (NormAct(), True, 1), (NormAct(affine=False), False, 1), (NormReused(), False, 0),
])
def test_forced_on_cpu(module, channels_last, expected):
    x = torch.randn(2, 12, 5, 7)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    compiled = kiln.compile(module, options=ON)
    assert rel_err(compiled(x), module(x)) < 1e-5
    assert kiln.stats(compiled).pass_counts["fuse_group_norm_silu"] == expected


def test_sd15_unet_resblocks_are_fused():
    spec = MODELS["sd15"]
    unet = spec.build("tiny")
    args, kwargs = spec.inputs(unet, batch=2)
    compiled = kiln.compile(unet, options=ON.replace(compile_unit="whole"))  # every instance in one graph
    assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-5
    # every ResnetBlock2D has norm1 -> SiLU and norm2 -> SiLU; the output head has norm_out -> SiLU
    resnets = sum(1 for m in unet.modules() if type(m).__name__ == "ResnetBlock2D")
    assert kiln.stats(compiled).pass_counts["fuse_group_norm_silu"] == 2 * resnets + 1
