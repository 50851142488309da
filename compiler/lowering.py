"""How a rewritten FX graph becomes callable: one `Lowering` per mode, described once.

Everything that depends on the mode asks its Lowering (does it use Inductor? can it lower a
graph again with static sizes?) instead of comparing mode strings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..choices import COMPILE_MODES
from . import compat


@dataclass(frozen=True)
class Lowering:
    mode: str               # a name of choices.COMPILE_MODES, which says what it means
    uses_inductor: bool     # Inductor generates the code (so `inductor` options apply, and it fuses neighbours itself)
    can_specialise: bool    # the shape manager may lower the captured graph again with static sizes
    inductor_preset: Optional[str] = None  # torch.compile(mode=...) settings applied on top, e.g. max-autotune

    @property
    def description(self) -> str:
        return COMPILE_MODES[self.mode]

    def lower(self, gm, example_inputs, options, device: str, cache_tag: str = ""):
        """(callable, name): the graph lowered for `device` with `options` (a CompileOptions).
        `cache_tag` goes into Inductor's FX graph cache key (Kiln's pass and kernel sources)."""
        cuda_graphs = bool(options.cuda_graphs and device == "cuda")
        if not self.uses_inductor:
            if cuda_graphs:
                return CudaGraphsPerShape(gm), "fx + cudagraphs"
            return gm.forward, "fx"
        config = compat.inductor_mode_options(self.inductor_preset) if self.inductor_preset else {}
        config["triton.cudagraphs"] = cuda_graphs
        config.update(options.inductor)
        with compat.inductor_config_patch(config), compat.cache_key_tag(cache_tag):
            compiled = compat.lookup_backend("inductor")(gm, example_inputs)
        name = "inductor" + (f" {self.inductor_preset}" if self.inductor_preset else "") + (" + cudagraphs" if cuda_graphs else "")
        return compiled, name


class CudaGraphsPerShape:
    """Mode fast's CUDA graphs, one recording per input shape signature. torch's `cudagraphs` backend
    records the shapes it first sees and copies every later input into buffers of those shapes, so a
    graph with dynamic sizes fails at its first new size ("The size of tensor a (2) must match the
    size of tensor b (4)", seen on an H200). Inductor keys its own recordings by the sizes; this does
    the same: a `cudagraphs` callable per signature (the tensors' shapes and the integer inputs),
    made on that signature's first call, each signature asked past Kiln's bound on recordings first
    (compat.cuda_graph_capture_allowed, as Inductor asks). A signature refused runs the graph as
    captured, without CUDA graphs."""

    def __init__(self, gm):
        self.gm = gm
        self.by_signature: dict[tuple, object] = {}

    def __call__(self, *args):
        signature = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        if not compat.cuda_graph_capture_allowed(signature):
            return self.gm(*args)
        recorded = self.by_signature.get(signature)
        if recorded is None:
            recorded = self.by_signature[signature] = compat.lookup_backend("cudagraphs")(self.gm, list(args))
        return recorded(*args)


LOWERINGS: dict[str, Lowering] = {lowering.mode: lowering for lowering in (
    Lowering("fast", uses_inductor=False, can_specialise=False),
    Lowering("balanced", uses_inductor=True, can_specialise=True),
    Lowering("max", uses_inductor=True, can_specialise=True, inductor_preset="max-autotune-no-cudagraphs"),
)}
assert tuple(LOWERINGS) == tuple(COMPILE_MODES), "one Lowering per compile mode of choices.py, in its order"
MODES = tuple(LOWERINGS)
