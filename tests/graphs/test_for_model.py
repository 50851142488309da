"""A KilnModel with whole-call graphs, on a CPU through the fake recorder: the wiring compiler/model.py uses
on a CUDA device with cuda_graphs auto (there with torch.cuda.CUDAGraph)."""
import functools

import pytest
import torch

import kiln
from kiln.compiler import CompileOptions, model as model_module
from kiln.compiler.graphs import for_model
from kiln.compiler.graphs.fake_recorder import FakeRecorder
from kiln.compiler.regional.regional_compile import RegionalCompile
from testing_utils import rel_err, two_region_net


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """cuda_graphs auto records on the CPU too, with the fake recorder."""
    monkeypatch.setattr(CompileOptions, "whole_call_graphs", lambda self, device: self.cuda_graphs is None)

    def fake(module, *args, **kwargs):
        return for_model.graphs_for_model(module, *args, recorder=FakeRecorder(module), record_on=("cpu",), **kwargs)

    monkeypatch.setattr(model_module, "graphs_for_model", fake)


def _compile(module):
    return kiln.compile(module, options=CompileOptions(mode="fast", measure_regions=False))


def test_on_the_cpu_auto_changes_nothing():
    compiled = _compile(two_region_net())
    compiled(torch.randn(2, 8, 3, 5))
    assert kiln.stats(compiled).cuda_graphs is None and "whole-call" not in kiln.stats(compiled).summary()


def test_by_blocks_the_whole_call_is_replayed_and_checked(graphs_on_cpu):
    module = two_region_net()
    compiled = _compile(module)
    for _ in range(5):
        x = torch.randn(2, 8, 3, 5)
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    graphs = info.cuda_graphs
    assert graphs.report.recordings == 1 and graphs.report.replays == 3
    # each region's first compiled call, and the recording's first replay on new inputs
    assert [c.what.split(" at ")[0] for c in graphs.guard.checks] == ["region Block#1", "region Block#2",
                                                                         "recording 1 (2x8x3x5)"]
    assert not graphs.guard.failures and "whole-call CUDA graphs: 1 recording(s)" in info.summary()
    assert "fidelity guard: 3 check(s), 0 failed, 3 extra call(s)" in info.summary()


def test_new_weights_recapture_and_never_recompile(graphs_on_cpu):
    module = two_region_net()
    compiled = _compile(module)
    for _ in range(4):
        compiled(torch.randn(2, 8, 3, 5))
    compiles = kiln.stats(compiled).compile_count
    # a LoRA as ComfyUI installs it: a new tensor, without grad
    module.blocks[0].fc.weight = torch.nn.Parameter(torch.randn_like(module.blocks[0].fc.weight), requires_grad=False)
    for _ in range(2):
        x = torch.randn(2, 8, 3, 5)
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.compile_count == compiles
    assert (info.cuda_graphs.report.recordings, info.cuda_graphs.report.recaptures) == (2, 1)


def test_a_region_that_returns_nan_runs_eagerly_with_the_reason(graphs_on_cpu, monkeypatch):
    use_guard = RegionalCompile.use_fidelity_guard

    def planting(self, guard):
        use_guard(self, guard)
        region = self.regions[0]
        region.compiled = functools.partial(lambda inner, *a, **k: inner(*a, **k) * float("nan"), region.compiled)

    monkeypatch.setattr(RegionalCompile, "use_fidelity_guard", planting)
    module = two_region_net()
    compiled = _compile(module)
    for _ in range(4):
        x = torch.randn(2, 8, 3, 5)
        assert rel_err(compiled(x), module(x)) < 1e-6  # the eager answer, never the NaN
    info = kiln.stats(compiled)
    assert list(info.regions_eager) == ["Block#1"] and info.eager_kinds["Block#1"] == "fidelity"
    assert "differed from eager" in info.regions_eager["Block#1"] and "NaN/inf where eager is finite" in \
        info.regions_eager["Block#1"]
    assert info.cuda_graphs.report.recordings == 1  # the rest of the call is still replayed


def test_compiled_whole_the_first_call_is_checked_and_a_nan_model_runs_eagerly(graphs_on_cpu, monkeypatch):
    module = two_region_net()
    compiled = kiln.compile(module, options=CompileOptions(mode="fast", compile_unit="whole"))
    for _ in range(4):
        x = torch.randn(2, 8, 3, 5)
        assert rel_err(compiled(x), module(x)) < 1e-6
    guard = kiln.stats(compiled).cuda_graphs.guard
    assert [c.what.split(" at ")[0] for c in guard.checks] == ["region whole model", "recording 1 (2x8x3x5)"]

    real_compile = torch.compile

    def nan_compile(fn, **kwargs):
        compiled_fn = real_compile(fn, **kwargs)
        return lambda *a, **k: compiled_fn(*a, **k) * float("nan")

    monkeypatch.setattr(torch, "compile", nan_compile)
    module = two_region_net()
    compiled = kiln.compile(module, options=CompileOptions(mode="fast", compile_unit="whole"))
    for _ in range(3):
        x = torch.randn(2, 8, 3, 5)
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.fallback.startswith("the compiled model: its first compiled call at 2x8x3x5 differed from eager")
