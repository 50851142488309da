"""fuse_geglu: `a, gate = y.chunk(2, dim=-1); a * gelu(gate)` -> one Kiln kernel (kiln::geglu).

The feed-forward of every SD1.5/SD2/SDXL transformer block (diffusers' and ComfyUI's GEGLU).
Eager writes the gelu result and the product as two tensors of half the projection's width;
the kernel reads the projection once and writes the product once.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ... import kernels  # noqa: F401  (registers torch.ops.kiln.*)
from .base import MUL, GraphPass, PassContext, PassResult, arg, erase_unused, is_call, kernel_gate, only_user, value

GELU = (F.gelu, torch._C._nn.gelu)
CHUNK = (torch.chunk,)


def pattern_geglu(y, approximate: str = "none"):
    a, gate = y.chunk(2, dim=-1)
    return a * F.gelu(gate, approximate=approximate)


def replacement_geglu(y, approximate: str = "none"):
    return torch.ops.kiln.geglu(y, approximate)


def example_inputs():
    return (torch.randn(3, 7, 2 * 45),)


def _halves(chunk: torch.fx.Node):
    """The getitem nodes taking halves 0 and 1 of a 2-way chunk, or None."""
    halves = {}
    for user in chunk.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            return None
        halves[user.args[1]] = user
    return (halves.get(0), halves.get(1)) if len(halves) == 2 and len(chunk.users) == 2 else None


class FuseGeglu(GraphPass):
    name = "fuse_geglu"
    kernel_op = "kiln::geglu"
    description = "chunk(2, dim=-1) + a * gelu(gate) -> kiln::geglu"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        for chunk in list(graph.nodes):
            if not is_call(chunk, CHUNK, ("chunk",)):
                continue
            y = chunk.args[0]
            y_val = value(y)
            if y_val is None or arg(chunk, 1, "chunks") != 2:
                continue
            dim = arg(chunk, 2, "dim", 0)
            if dim not in (-1, y_val.dim() - 1):
                continue
            halves = _halves(chunk)
            if halves is None:
                continue
            a, gate = halves
            gelu = only_user(gate)
            if gelu is None or not is_call(gelu, GELU, ("gelu",)):
                continue
            mul = only_user(gelu)
            if mul is None or not is_call(mul, MUL, ("mul",)) or set(mul.args[:2]) != {a, gelu} or only_user(a) is not mul:
                continue
            if not y_val.is_floating_point():
                result.skip("GEGLU input is not floating point")
                continue
            if not kernel_gate(ctx, result, "GEGLU"):
                continue
            approximate = arg(gelu, 1, "approximate", "none")
            with graph.inserting_before(mul):
                fused = graph.call_function(torch.ops.kiln.geglu.default, (y, approximate))
            fused.meta.update(mul.meta)
            mul.replace_all_uses_with(fused)
            erase_unused(graph, mul, gelu, a, gate, chunk)
            result.rewrites += 1
