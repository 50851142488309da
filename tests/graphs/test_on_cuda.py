"""Kiln's default on a CUDA device: the whole call recorded and replayed, checked by the fidelity guard,
re-captured for new weights without recompiling, and a planted NaN region caught (skipped elsewhere;
`bash benchmarks/gpu_session.sh graphs CASE` runs it first)."""
import functools

import pytest
import torch

import kiln
from kiln.compiler.regional.regional_compile import RegionalCompile
from testing_utils import rel_err, two_region_net

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOLERANCE = 2e-3  # fp32 with TF32 (compiler/graphs/fidelity_guard.py FP32_TF32_TOLERANCE)


def _calls(compiled, module, n=6):
    for _ in range(n):
        x = torch.randn(2, 8, 3, 5, device="cuda")
        assert rel_err(compiled(x), module(x)) < TOLERANCE


def test_the_default_replays_the_whole_call():
    module = two_region_net().cuda()
    compiled = kiln.compile(module)
    _calls(compiled, module)
    info = kiln.stats(compiled)
    report = info.cuda_graphs.report
    assert report.recordings == 1 and report.replays >= 3 and report.nbytes > 0, info.summary()
    assert not info.cuda_graphs.guard.failures, info.cuda_graphs.guard.line()
    print(info.summary())


def test_new_weights_recapture_without_recompiling():
    module = two_region_net().cuda()
    compiled = kiln.compile(module)
    _calls(compiled, module, 4)
    compiles = kiln.stats(compiled).compile_count
    fc = module.blocks[0].fc
    fc.weight = torch.nn.Parameter(torch.randn_like(fc.weight), requires_grad=False)
    _calls(compiled, module, 3)
    info = kiln.stats(compiled)
    assert info.compile_count == compiles and info.cuda_graphs.report.recaptures == 1, info.summary()
    print(f"re-capture: {info.cuda_graphs.report.capture_seconds[-1]:.3f} s")


def test_a_planted_nan_region_runs_eagerly(monkeypatch):
    use_guard = RegionalCompile.use_fidelity_guard

    def planting(self, guard):
        use_guard(self, guard)
        region = self.regions[0]
        region.compiled = functools.partial(lambda inner, *a, **k: inner(*a, **k) * float("nan"), region.compiled)

    monkeypatch.setattr(RegionalCompile, "use_fidelity_guard", planting)
    module = two_region_net().cuda()
    compiled = kiln.compile(module)
    _calls(compiled, module)
    info = kiln.stats(compiled)
    assert info.eager_kinds.get("Block#1") == "fidelity", info.summary()
