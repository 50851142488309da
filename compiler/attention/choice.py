"""Which attention kernel runs a shape: measured on the device, under a fidelity check, once a process per shape.

For an attention shape (`AttentionKey`: batch, heads, query and key tokens, head sizes, dtype) every
candidate backend (compiler/attention/backends.py) that can run there is called on random inputs of
that shape on the model's device:

1. **Fidelity.** Its output on the first REFERENCE_HEADS heads is compared with SDPA's math backend
   computed in float32 on the same inputs: its relative L2 error must be within FIDELITY_TOLERANCE of
   its dtype (ten times the dtype's unit roundoff: float16 5e-3, bfloat16 4e-2, float32 1e-5). A
   backend over it is left out, with its error said: a fast kernel that changes the image is no choice.
2. **Speed.** Each backend left is timed by the region choice's clock (compiler/regional/gpu_time.py:
   the GPU's own time on CUDA, the wall clock elsewhere), TIMED_CALLS calls a sample after WARM_UP_CALLS,
   the median of SAMPLES samples; the fastest is chosen (a lone candidate left is chosen untimed).

The choice (`AttentionChoice`) holds every backend's time and every reason one was left out; its
`line()` is what the log and the compile's record (`GraphCompile.notes`) say. A backend that fails to
run the shape (raises) is left out like one that is not installed. Choices are kept per process
(`chosen_for`), keyed by the shape, the device and whether only in-graph backends may be chosen.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ..regional.gpu_time import RegionClock, clock_for
from .backends import BACKENDS, BY_NAME, AttentionBackend

log = logging.getLogger("kiln")

REFERENCE = "math"  # SDPA's math backend, in float32: what every candidate is checked against
# relative L2 error against the reference allowed per dtype: ten times the dtype's unit roundoff
FIDELITY_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-5}
REFERENCE_HEADS = 4  # heads of the first sample the check compares (the float32 reference holds an L x S matrix a head)
WARM_UP_CALLS = 2
TIMED_CALLS = 10
SAMPLES = 5


@dataclass(frozen=True)
class AttentionKey:
    """An attention call's shape: q (batch, heads, q_tokens, head_dim), k (.., kv_tokens, head_dim), v (.., v_dim)."""

    batch: int
    heads: int
    q_tokens: int
    kv_tokens: int
    head_dim: int
    v_dim: int
    dtype: torch.dtype

    def line(self) -> str:
        dims = f"d{self.head_dim}" + (f"/{self.v_dim}" if self.v_dim != self.head_dim else "")
        return (f"{self.batch}x{self.heads} heads, {self.q_tokens} x {self.kv_tokens} tokens, {dims}, "
                f"{str(self.dtype).replace('torch.', '')}")


@dataclass(frozen=True)
class AttentionChoice:
    """What was measured for one shape and which backend won."""

    key: AttentionKey
    backend: str
    basis: str                                            # the clock's (GPU time, the host's wall clock); '' untimed
    times_ms: dict = field(default_factory=dict)          # backend -> ms a call
    errors: dict = field(default_factory=dict)            # backend -> relative L2 error against the reference
    left_out: dict = field(default_factory=dict)          # backend -> why it is no candidate

    def line(self) -> str:
        times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(self.times_ms.items(), key=lambda t: t[1]))
        out = "; ".join(f"{name}: {why}" for name, why in self.left_out.items())
        how = f"chosen by {self.basis} ({times})" if self.times_ms else "the only candidate left"
        return f"attention {self.key.line()}: {self.backend} {how}" + (f"; left out: {out}" if out else "")


def relative_l2(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference||, in float32."""
    reference = reference.float()
    return ((out.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def random_inputs(key: AttentionKey, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=device).manual_seed(seed)

    def make(tokens: int, dim: int) -> torch.Tensor:
        shape = (key.batch, key.heads, tokens, dim)
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(key.dtype)

    return make(key.q_tokens, key.head_dim), make(key.kv_tokens, key.head_dim), make(key.kv_tokens, key.v_dim)


def choose(key: AttentionKey, device: torch.device, scale: Optional[float],
           backends: Iterable[AttentionBackend] = BACKENDS, clock: Optional[RegionClock] = None,
           in_graph_only: bool = True) -> AttentionChoice:
    """The fastest backend for `key` on `device` among `backends` that pass the fidelity check (see the
    module docstring); `clock` as the region choice's (`clock_for(device.type)` by default)."""
    clock = clock or clock_for(device.type)
    q, k, v = random_inputs(key, device)
    heads = slice(0, REFERENCE_HEADS)
    reference = BY_NAME[REFERENCE].run(q[:1, heads].float(), k[:1, heads].float(), v[:1, heads].float(), scale)
    tolerance = FIDELITY_TOLERANCE.get(key.dtype)
    times, errors, left_out = {}, {}, {}
    for backend in backends:
        why = _why_not(backend, device, in_graph_only, tolerance, key)
        if why:
            left_out[backend.name] = why
            continue
        try:
            out = backend.run(q, k, v, scale)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:  # the backend cannot run this shape
            left_out[backend.name] = f"cannot run it ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
            continue
        errors[backend.name] = error = relative_l2(out[:1, heads], reference)
        if not error <= tolerance:
            left_out[backend.name] = (f"relative L2 error {error:.1e} against float32 math, over the "
                                      f"{tolerance:.0e} allowed for {str(key.dtype).replace('torch.', '')}")
            continue
        times[backend.name] = backend.run
    if not times:
        raise RuntimeError(f"no attention backend ran {key.line()} within its fidelity tolerance: "
                           + "; ".join(f"{n}: {w}" for n, w in left_out.items()))
    if len(times) == 1:  # nothing to choose between: not timed
        return AttentionChoice(key, next(iter(times)), "", {}, errors, left_out)
    times = {name: _time(clock, lambda run=run: run(q, k, v, scale)) for name, run in times.items()}
    best = min(times, key=times.get)
    return AttentionChoice(key, best, clock.basis, times, errors, left_out)


def _why_not(backend: AttentionBackend, device: torch.device, in_graph_only: bool, tolerance, key) -> str:
    if tolerance is None:
        return f"no fidelity tolerance for {key.dtype}"
    if device.type not in backend.devices:
        return f"does not run on {device.type}"
    if in_graph_only and not backend.in_graph:
        return "a Python call Inductor cannot lower (chosen in mode fast only)"
    return backend.missing()


def _time(clock: RegionClock, call) -> float:
    for _ in range(WARM_UP_CALLS):
        call()

    def run():
        for _ in range(TIMED_CALLS):
            call()

    return statistics.median(clock.sample(run).ms for _ in range(SAMPLES)) / TIMED_CALLS


_chosen: dict[tuple, AttentionChoice] = {}


def chosen_for(key: AttentionKey, device: torch.device, scale: Optional[float], in_graph_only: bool) -> AttentionChoice:
    """`choose`, once a process per (shape, device, in_graph_only, scale), said in the log when measured."""
    memo = (key, str(device), in_graph_only, scale)
    if memo not in _chosen:
        _chosen[memo] = choice = choose(key, device, scale, in_graph_only=in_graph_only)
        log.info("Kiln: %s", choice.line())
    return _chosen[memo]
