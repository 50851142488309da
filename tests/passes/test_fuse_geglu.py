import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.compiler.passes import fuse_geglu as pass_module
from testing_utils import rel_err

ON = kiln.CompileOptions(mode="fast", passes={"fuse_geglu": "on"})


def test_replacement_equals_pattern():
    (y,) = pass_module.example_inputs()
    for approximate in ("none", "tanh"):
        ref = pass_module.pattern_geglu(y, approximate)
        assert rel_err(pass_module.replacement_geglu(y, approximate), ref) < 1e-6


class GEGLU(torch.nn.Module):  # ComfyUI's / diffusers' GEGLU with its projection
    def __init__(self, dim=12, inner=17, gate_first=False, approximate="none"):
        super().__init__()
        self.proj = torch.nn.Linear(dim, inner * 2)
        self.gate_first, self.approximate = gate_first, approximate

    def forward(self, x):
        a, gate = self.proj(x).chunk(2, dim=-1)
        g = F.gelu(gate, approximate=self.approximate)
        return g * a if self.gate_first else a * g


class NotGEGLU(torch.nn.Module):  # the halves are used elsewhere too: the pass must not fire
    def forward(self, y):
        a, gate = y.chunk(2, dim=-1)
        return a * F.gelu(gate) + a


@pytest.mark.parametrize("module, expected", [
    (GEGLU(), 1), (GEGLU(gate_first=True), 1), (GEGLU(approximate="tanh"), 1), (NotGEGLU(), 0),
])
def test_forced_on_cpu(module, expected):
    x = torch.randn(3, 5, 12) if isinstance(module, GEGLU) else torch.randn(3, 5, 34)
    compiled = kiln.compile(module, options=ON)
    assert rel_err(compiled(x), module(x)) < 1e-5
    (graph,) = kiln.stats(compiled).compiles  # one graph: what it rewrote, and nothing left alone
    assert graph.rewrites["fuse_geglu"] == expected and not graph.skipped.get("fuse_geglu")


def test_auto_leaves_cpu_graph_to_inductor_and_says_why():
    module, x = GEGLU(), torch.randn(2, 3, 12)
    compiled = kiln.compile(module, mode="fast")
    compiled(x)
    info = kiln.stats(compiled)
    assert info.pass_counts["fuse_geglu"] == 0
    assert "cpu has no Triton kernel here" in info.compiles[0].skipped["fuse_geglu"][0]


def test_grad_enabled_is_never_fused():
    module, x = GEGLU(), torch.randn(2, 3, 12)
    compiled = kiln.compile(module, options=ON)
    with torch.enable_grad():
        compiled(x)
    info = kiln.stats(compiled)
    assert info.pass_counts["fuse_geglu"] == 0
    assert "autograd is enabled" in info.compiles[0].skipped["fuse_geglu"][0]


# Every GEGLU of a real UNet fused, in one whole SDXL graph: tests/compiler/test_compile_models.py's
# test_sdxl_fast_mode_all_passes (one compile for both, with every other pass on).


def test_cuda_without_triton_is_skipped_with_the_reason():
    from kiln.compiler.passes.base import PassContext, PassResult, kernel_gate

    result = PassResult("fuse_geglu")
    assert not kernel_gate(PassContext(device_type="cuda", triton=False), result, "GEGLU")
    assert result.skipped == ["GEGLU: Triton is not installed"]
    assert kernel_gate(PassContext(device_type="cuda", triton=True), PassResult("x"), "GEGLU")
