"""On CUDA every region is measured (compiler/regional/gpu_choice.py): no class verdict, no run-as-captured
shortcut; elsewhere both stay. The CUDA case is played on a CPU with the device the region choice reads
set to "cuda" and the timings injected."""
import torch

import kiln
from kiln.compiler.regional import gpu_choice, regional_compile
from testing_utils import answer_region_timings, rel_err


class Mix(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm, self.mix = torch.nn.GroupNorm(2, channels), torch.nn.Linear(channels, channels)

    def forward(self, x):
        h = torch.nn.functional.silu(self.norm(x))
        return x + self.mix(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)[:, :x.shape[1]]


class Widths(torch.nn.Module):
    """Three Mix blocks of three widths: three regions of one class."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Mix(4), Mix(4), Mix(6), Mix(6), Mix(8), Mix(8)])

    def forward(self, x):
        for block in self.blocks:
            pad = block.mix.in_features - x.shape[1]
            x = block(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)))
        return x


def _run(monkeypatch, device, answers):
    if device == "cuda":
        monkeypatch.setattr(regional_compile, "device_type_of", lambda values: "cuda")
    devices = answer_region_timings(monkeypatch, answers)
    torch.manual_seed(0)
    module, x = Widths().eval(), torch.randn(2, 4, 5, 5)
    compiled = kiln.compile(module, mode="balanced")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
    return kiln.stats(compiled), devices


def test_on_cuda_every_region_of_a_class_whose_first_measured_slower_is_measured(monkeypatch):
    answers = [(1.1, 1.0), (0.5, 1.0), (0.5, 1.0)]  # Mix#1 slower compiled; Mix#2 and Mix#3 faster
    info, devices = _run(monkeypatch, "cuda", answers)
    assert not answers and devices == ["cuda"] * 3
    assert list(info.region_timings) == ["Mix#1", "Mix#2", "Mix#3"]
    assert list(info.regions_eager) == ["Mix#1"]  # by its own measure, not its class's


def test_on_a_cpu_the_class_verdict_still_holds(monkeypatch):
    answers = [(1.1, 1.0)]
    info, devices = _run(monkeypatch, "cpu", answers)
    assert not answers and devices == ["cpu"]
    assert info.regions_eager["Mix#2"].startswith("not compiled: the first region of its class (Mix#1)")


def test_the_shortcuts_hold_everywhere_but_on_cuda():
    assert not gpu_choice.judged_by_class("cuda") and not gpu_choice.runs_as_captured_when_idle("cuda")
    assert gpu_choice.judged_by_class("cpu") and gpu_choice.runs_as_captured_when_idle("cpu")


def test_the_glue_is_compiled_by_default_on_cuda_only():
    assert gpu_choice.compiles_glue_by_default("cuda") and not gpu_choice.compiles_glue_by_default("cpu")
