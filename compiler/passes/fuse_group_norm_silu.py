"""fuse_group_norm_silu: GroupNorm followed by SiLU -> one Kiln kernel (kiln::group_norm_silu).

Every UNet ResBlock (SD1.5, SD2, SDXL) and VAE block starts with GroupNorm then SiLU: two
full passes over the activation in eager. The Kiln kernel reads it once for the statistics and
once to write the normalised, activated result, in NCHW or channels-last.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels  # noqa: F401  (registers torch.ops.kiln.*)
from .base import GraphPass, PassContext, PassResult, arg, erase_unused, is_call, kernel_gate, only_user, value

GROUP_NORM = (F.group_norm,)
SILU = (F.silu, torch._C._nn.silu)


def pattern_group_norm_silu(x, weight, bias, num_groups: int = 2, eps: float = 1e-5):
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps))


def replacement_group_norm_silu(x, weight, bias, num_groups: int = 2, eps: float = 1e-5):
    return torch.ops.kiln.group_norm_silu(x, num_groups, weight, bias, eps, True)


def example_inputs():
    return (torch.randn(2, 6, 5, 7), torch.randn(6), torch.randn(6))


class FuseGroupNormSilu(GraphPass):
    name = "fuse_group_norm_silu"
    kernel_op = "kiln::group_norm_silu"
    description = "GroupNorm followed by SiLU -> kiln::group_norm_silu"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        for silu in list(graph.nodes):
            if not is_call(silu, SILU, ("silu",)):
                continue
            norm = silu.args[0] if silu.args else silu.kwargs.get("input")
            if not isinstance(norm, torch.fx.Node) or not is_call(norm, GROUP_NORM) or only_user(norm) is not silu:
                continue
            if arg(silu, 1, "inplace", False):
                result.skip("in-place SiLU (its input is reused)")
                continue
            x = arg(norm, 0, "input")
            x_val = value(x)
            if x_val is None or x_val.dim() < 3 or not x_val.is_floating_point():
                result.skip("GroupNorm input is not a floating (N, C, ...) tensor")
                continue
            if not kernel_gate(ctx, result, "GroupNorm+SiLU"):
                continue
            eps = arg(norm, 4, "eps", 1e-5)
            if not isinstance(eps, (int, float)):
                result.skip("GroupNorm eps is not a constant in this graph (the kernel takes a fixed eps)")
                continue
            with graph.inserting_before(silu):
                fused = graph.call_function(
                    torch.ops.kiln.group_norm_silu.default,
                    (x, arg(norm, 1, "num_groups"), arg(norm, 2, "weight"), arg(norm, 3, "bias"),
                     float(eps), True),
                )
            fused.meta.update(silu.meta)
            silu.replace_all_uses_with(fused)
            erase_unused(graph, silu, norm)
            result.rewrites += 1
