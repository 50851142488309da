"""The fidelity guard's tolerances, its NaN rule, and that nothing is checked twice."""
import pytest
import torch

from kiln.compiler.graphs.fidelity_guard import (BF16_TOLERANCE, FP16_TOLERANCE, FP32_TF32_TOLERANCE,
                                                 FP32_TOLERANCE, FidelityGuard, compare, tf32_in_use,
                                                 tolerance_for)


def with_rel_error(ref: torch.Tensor, rel: float) -> torch.Tensor:
    """`ref` plus noise of relative L2 size `rel` (computed in float64, then cast)."""
    noise = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    noise *= rel * ref.double().norm() / noise.norm()
    return (ref.double() + noise).to(ref.dtype)


def test_the_tolerance_table():
    assert (FP32_TOLERANCE, FP32_TF32_TOLERANCE, FP16_TOLERANCE, BF16_TOLERANCE) == (1e-4, 2e-3, 5e-3, 2e-2)
    assert tolerance_for(torch.float32) == FP32_TOLERANCE
    assert tolerance_for(torch.float32, tf32=True) == FP32_TF32_TOLERANCE
    assert tolerance_for(torch.float16, tf32=True) == FP16_TOLERANCE
    assert tolerance_for(torch.bfloat16) == BF16_TOLERANCE
    assert tolerance_for(torch.float64) == FP32_TOLERANCE
    assert not tf32_in_use("cpu")


@pytest.mark.parametrize("dtype,tf32,tolerance", [(torch.float32, False, FP32_TOLERANCE),
                                                  (torch.float32, True, FP32_TF32_TOLERANCE),
                                                  (torch.float16, False, FP16_TOLERANCE),
                                                  (torch.bfloat16, False, BF16_TOLERANCE)])
def test_tolerance_edges_per_dtype(dtype, tf32, tolerance):
    # fp64 reference values cast to the dtype; the error is planted at 0.5x and 2x the tolerance
    # (an fp16/bf16 cast's own rounding is far below both: 2^-11, 2^-8 relative per element)
    ref = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    inside = compare(with_rel_error(ref, tolerance * 0.5), ref, tf32)
    outside = compare(with_rel_error(ref, tolerance * 2), ref, tf32)
    assert inside.passed and inside.tolerance == tolerance, inside.line()
    assert not outside.passed and "over the tolerance" in outside.line()


def test_nan_counts_only_where_eager_is_finite():
    ref = torch.ones(8)
    ref[0] = float("nan")  # eager's own NaN: not the compiled code's fault
    out = ref.clone()
    assert compare(out, ref).passed
    out[3] = float("inf")
    planted = compare(out, ref)
    assert planted.new_nonfinite == 1 and not planted.passed
    assert "1 NaN/inf where eager is finite" in planted.line()


def test_structure_mismatch_fails_with_a_reason():
    assert "2 tensors" in compare((torch.ones(2), torch.ones(2)), torch.ones(2)).line()
    assert not compare(torch.ones(3), torch.ones(2)).passed
    assert compare({"a": torch.ones(2), "b": [torch.zeros(2)]}, {"a": torch.ones(2), "b": [torch.zeros(2)]}).passed


def test_checked_once_with_its_cost_counted():
    guard = FidelityGuard()
    calls = []

    def eager():
        calls.append(1)
        return torch.ones(4)

    nan_region = torch.full((4,), float("nan"))  # a planted fault: a region that returns NaN
    first = guard.check_once(("region", "Block#1", (2, 4)), "region Block#1 at 2x4", nan_region, eager)
    assert not first.passed and first.new_nonfinite == 4
    assert guard.check_once(("region", "Block#1", (2, 4)), "again", nan_region, eager) is None
    assert guard.check_once(("region", "Block#1", (3, 4)), "region Block#1 at 3x4", torch.ones(4), eager).passed
    assert len(calls) == guard.extra_calls == 2
    assert [c.what for c in guard.failures] == ["region Block#1 at 2x4"]
    assert "2 check(s), 1 failed, 2 extra call(s)" in guard.line() and "Block#1 at 2x4" in guard.line()


def test_a_region_check_runs_eager_on_copies_taken_before_the_compiled_call():
    from kiln.compiler.graphs.fidelity_guard import region_check

    def block(x, options):  # updates its input in place, as ComfyUI's Flux blocks add to theirs
        x.add_(options["shift"])
        return x * 2

    guard = FidelityGuard()
    x, options = torch.ones(3), {"shift": torch.ones(3)}
    check = region_check(guard, "Block#1", (x,), {"options": options})
    out = block(x, options)  # the "compiled" call
    why, answer = check.finish(guard, out, lambda a, k: block(*a, **k), "cpu")
    assert why == "" and answer is out and guard.extra_calls == 1
    assert region_check(guard, "Block#1", (torch.ones(3),), {"options": options}) is None  # checked once
    check = region_check(guard, "Block#1", (torch.ones(4),), {"options": {"shift": torch.ones(4)}})
    why, answer = check.finish(guard, torch.full((4,), float("nan")), lambda a, k: block(*a, **k), "cpu")
    assert why.startswith("its first compiled call at 4, 4 differed from eager: rel L2") and torch.equal(answer,
                                                                                                       torch.full((4,), 4.0))
