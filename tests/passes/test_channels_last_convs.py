import torch
import torch.nn.functional as F

import kiln
from kiln.testing.models import MODELS
from kiln.compiler.passes import channels_last_convs as pass_module
from testing_utils import rel_err

ON = kiln.CompileOptions(mode="fast", passes={"channels_last_convs": "on"})


def test_replacement_equals_pattern():
    x, w, b = pass_module.example_inputs()
    out = pass_module.replacement_channels_last_convs(x, w, b)
    assert rel_err(out, pass_module.pattern_channels_last_convs(x, w, b)) < 1e-5
    assert out.is_contiguous()


class ConvStack(torch.nn.Module):
    def __init__(self, n=5):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(6, 6, 3, padding=1) for _ in range(n))

    def forward(self, x):
        for conv in self.convs:
            x = F.silu(conv(x))
        return x


def test_forced_on_rewrites_every_conv_and_returns_eager_layout():
    module, x = ConvStack(), torch.randn(2, 6, 9, 11)
    compiled = kiln.compile(module, options=ON)
    out = compiled(x)
    assert rel_err(out, module(x)) < 1e-5
    assert out.is_contiguous()  # eager returned NCHW, so does the compiled graph
    assert kiln.stats(compiled).pass_counts["channels_last_convs"] == 5


def test_auto_skips_small_graphs_and_cpu_with_reasons():
    for n, reason in ((2, "fewer than 4"), (5, "cpu: channels-last convolutions measured no faster")):
        compiled = kiln.compile(ConvStack(n), mode="fast")
        compiled(torch.randn(1, 6, 8, 8))
        info = kiln.stats(compiled)
        assert info.pass_counts["channels_last_convs"] == 0
        assert reason in info.compiles[0].skipped["channels_last_convs"][0]


def test_sd15_unet_in_channels_last():
    spec = MODELS["sd15"]
    unet = spec.build("tiny")
    args, kwargs = spec.inputs(unet, batch=2)
    compiled = kiln.compile(unet, options=ON.replace(compile_unit="whole"))  # every conv in one graph
    assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-5
    convs = sum(1 for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    assert kiln.stats(compiled).pass_counts["channels_last_convs"] == convs
