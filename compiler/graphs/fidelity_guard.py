"""The fidelity guard: compiled code and recordings checked once against the code they replace.

Users see black or changed images when a compiled graph or a replay goes wrong (a kernel that
differs, a replay that read memory it should not have). The guard makes that impossible to miss:

- each compiled region, at each input signature, is checked on its first compiled call against its
  block run eagerly on the same inputs (`check_once` with the region and signature as what is checked);
- each recording of a whole call is checked on its first replay on inputs other than the ones it
  was recorded with, against the same call run without graphs (compiler/graphs/whole_call.py).

A check compares every tensor of the output with the reference's (`compare`): relative L2 error
over the elements where the reference is finite, against the tolerance for the reference's dtype
(`tolerance_for`: FP32_TOLERANCE, FP32_TF32_TOLERANCE where TF32 may be used, FP16_TOLERANCE,
BF16_TOLERANCE), and NaN or inf only counted where the reference is finite (NEW_NONFINITE_ALLOWED:
none). What fails runs eagerly (a region) or without graphs (a recording) from then on, with the
comparison's line as the reason. Each check costs one extra call of the reference, counted
(`extra_calls`) and reported (`line`); nothing is checked twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from ..torch_compat import module_calls

# relative L2 tolerance by the reference's dtype (to recalibrate on a CUDA machine at 4x the p99 of
# torch.compile's per-region error)
FP32_TOLERANCE = 1e-4
FP32_TF32_TOLERANCE = 2e-3   # fp32 where matmuls or convolutions may run in TF32 on a CUDA device
FP16_TOLERANCE = 5e-3
BF16_TOLERANCE = 2e-2
TOLERANCES = {torch.float32: FP32_TOLERANCE, torch.float16: FP16_TOLERANCE, torch.bfloat16: BF16_TOLERANCE}
NEW_NONFINITE_ALLOWED = 0    # NaN or inf where the reference is finite


def tf32_in_use(device: str) -> bool:
    """Whether fp32 matmuls or convolutions may run in TF32 on `device` (torch's float32 matmul
    precision below "highest", or cuDNN's allow_tf32, which is on by default)."""
    if not str(device).startswith("cuda"):
        return False
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cudnn.allow_tf32)


def tolerance_for(dtype: torch.dtype, tf32: bool = False) -> float:
    """The relative L2 tolerance for an output of `dtype` (FP32_TOLERANCE for dtypes not in TOLERANCES:
    wider floats are held to fp32's)."""
    if dtype == torch.float32 and tf32:
        return FP32_TF32_TOLERANCE
    return TOLERANCES.get(dtype, FP32_TOLERANCE)


@dataclass(frozen=True)
class Comparison:
    """One output against its reference."""

    rel_l2: float            # over the elements where the reference is finite (and the output too)
    tolerance: float         # the loosest of the tensors' dtypes' tolerances
    new_nonfinite: int       # elements NaN or inf in the output where the reference is finite
    elements: int
    problem: str = ""        # the outputs do not match in structure, shape or dtype

    @property
    def passed(self) -> bool:
        return not self.problem and self.new_nonfinite <= NEW_NONFINITE_ALLOWED and self.rel_l2 <= self.tolerance

    def line(self) -> str:
        if self.problem:
            return self.problem
        nonfinite = f", {self.new_nonfinite} NaN/inf where eager is finite" if self.new_nonfinite else ""
        verdict = "within" if self.passed else "over"
        return f"rel L2 {self.rel_l2:.2e} {verdict} the tolerance {self.tolerance:.0e}{nonfinite}"


def compare(output: Any, reference: Any, tf32: bool = False) -> Comparison:
    """`output` against `reference` (tensors, or containers of them alike in structure)."""
    outs, refs = _tensors(output), _tensors(reference)
    if len(outs) != len(refs) or not refs:
        return Comparison(float("inf"), 0.0, 0, 0, f"the output holds {len(outs)} tensors, the reference {len(refs)}")
    diff_sq, ref_sq, nonfinite, elements, tolerance = 0.0, 0.0, 0, 0, 0.0
    for out, ref in zip(outs, refs):
        if out.shape != ref.shape:
            return Comparison(float("inf"), 0.0, 0, 0, f"an output of shape {tuple(out.shape)} against {tuple(ref.shape)}")
        tolerance = max(tolerance, tolerance_for(ref.dtype, tf32))
        out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
        ref_finite = torch.isfinite(ref64)
        out_finite = torch.isfinite(out64)
        nonfinite += int((ref_finite & ~out_finite).sum())
        both = ref_finite & out_finite
        diff_sq += float(((out64 - ref64)[both] ** 2).sum())
        ref_sq += float((ref64[both] ** 2).sum())
        elements += ref.numel()
    rel = (diff_sq ** 0.5) / (ref_sq ** 0.5) if ref_sq > 0 else diff_sq ** 0.5
    return Comparison(rel, tolerance, nonfinite, elements)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    module_calls.map_tensors(found.append, value)
    return [t for t in found if t.is_floating_point() or t.is_complex()]


@dataclass
class Check:
    what: str                 # "region Transformer#1 at 2x77x768, ...", "recording 2x4x128x128, ..."
    comparison: Comparison


class FidelityGuard:
    """One model's checks: what was checked (never twice), what failed, and what the checks cost."""

    def __init__(self):
        self._checked: set = set()
        self.checks: list[Check] = []
        self.extra_calls = 0

    def due(self, what: Hashable) -> bool:
        return what not in self._checked

    def check_once(self, what: Hashable, label: str, output: Any, reference: Callable[[], Any],
                   tf32: bool = False) -> Optional[Comparison]:
        """Compare `output` with `reference()` (one extra call) unless `what` was checked before
        (then None, at no cost)."""
        if what in self._checked:
            return None
        self._checked.add(what)
        self.extra_calls += 1
        comparison = compare(output, reference(), tf32)
        self.checks.append(Check(label, comparison))
        return comparison

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.comparison.passed]

    def line(self) -> str:
        failed = self.failures
        what = f"; failed: {'; '.join(f'{c.what} ({c.comparison.line()})' for c in failed)}" if failed else ""
        return (f"fidelity guard: {len(self.checks)} check(s), {len(failed)} failed, "
                f"{self.extra_calls} extra call(s){what}")


@dataclass
class RegionCheck:
    """A region's first compiled call at an input signature, to check against its block run eagerly on
    copies of the same inputs, taken before the compiled call (a block may update its input in place,
    as ComfyUI's Flux blocks add to theirs)."""

    what: tuple
    label: str
    args: tuple
    kwargs: dict

    def finish(self, guard: FidelityGuard, output: Any, eager: Callable[[tuple, dict], Any],
               device: str) -> tuple[str, Any]:
        """("", output) when the compiled output passes; (why, eager's output) when it fails: the region
        then runs eagerly, with `why` as the reason."""
        reference: list = []

        def run_eagerly():
            reference.append(eager(self.args, self.kwargs))
            return reference[0]

        comparison = guard.check_once(self.what, self.label, output, run_eagerly, tf32_in_use(device))
        if comparison is None or comparison.passed:
            return "", output
        return f"its first compiled call at {self.label.split(' at ', 1)[1]} differed from eager: {comparison.line()}", \
            reference[0]


def region_check(guard: FidelityGuard, region: str, args: tuple, kwargs: dict) -> Optional[RegionCheck]:
    """The check due for a call of `region` with these inputs (once per input signature: each tensor's
    shape and dtype), with copies of the inputs; None when that signature was checked already."""
    signature = tuple((tuple(t.shape), t.dtype) for t in _input_tensors(args, kwargs))
    what = ("region", region, signature)
    if not guard.due(what):
        return None
    shapes = ", ".join("x".join(map(str, shape)) for shape, _ in signature[:3])
    copies = module_calls.map_tensors(torch.clone, (args, kwargs))
    return RegionCheck(what, f"region {region} at {shapes}", copies[0], copies[1])


def _input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    module_calls.map_tensors(found.append, (args, kwargs))
    return found


__all__ = ["FidelityGuard", "RegionCheck", "region_check", "Comparison", "Check", "compare", "tolerance_for", "tf32_in_use", "TOLERANCES",
           "FP32_TOLERANCE", "FP32_TF32_TOLERANCE", "FP16_TOLERANCE", "BF16_TOLERANCE", "NEW_NONFINITE_ALLOWED"]
