"""fuse_adaln_modulation: `layer_norm(x) * scale + shift` -> one Kiln kernel (kiln::layer_norm_modulate).

AdaLN in every DiT block (SD3 and Flux in diffusers and ComfyUI, PixArt): normalise the tokens,
then modulate per sample and channel, `norm(x) * (1 + scale[:, None]) + shift[:, None]`. Eager
makes three passes over the activation; the kernel makes one. The multiplier is taken as the
graph computes it (the `1 + scale` on the small (B, C) tensor stays where it is).

Inductor fuses the same norm and modulation, together with the residual add before them, so in
modes balanced and max "auto" leaves it to Inductor; the kernel serves mode fast (no Inductor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels  # noqa: F401  (registers torch.ops.kiln.*)
from ...kernels.layer_norm_modulate import MAX_CHANNELS, out_dtype
from ..compat import size_expr
from .base import ADD, MUL, GraphPass, PassContext, PassResult, arg, erase_unused, is_call, kernel_gate, only_user, value

LAYER_NORM = (F.layer_norm, torch.layer_norm)


def pattern_adaln_modulation(x, scale, shift, eps: float = 1e-6):
    return F.layer_norm(x, (x.shape[-1],), None, None, eps) * (1 + scale) + shift


def replacement_adaln_modulation(x, scale, shift, eps: float = 1e-6):
    return torch.ops.kiln.layer_norm_modulate(x, None, None, eps, 1 + scale, shift)


def example_inputs():
    return (torch.randn(2, 7, 45) * 3 + 1, torch.randn(2, 1, 45), torch.randn(2, 1, 45))


def _other(node: torch.fx.Node, operand: torch.fx.Node):
    """The operand of a binary call that is not `operand` (None if both are, or it is not a node)."""
    a, b = (list(node.args) + [None, None])[:2]
    other = b if a is operand else a if b is operand else None
    return other if isinstance(other, torch.fx.Node) and other is not operand else None


def _modulates_per_sample_channel(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Shape (B or 1, 1, ..., 1, C or 1) right-aligned against x (B, ..., C), compared on the
    fake tensors' size expressions (a symbolic batch matches itself; nothing is guarded)."""
    if x.dim() < 2 or not 1 <= t.dim() <= x.dim():
        return False
    sizes = [1] * (x.dim() - t.dim()) + [size_expr(s) for s in t.shape]
    batch, channels = size_expr(x.shape[0]), size_expr(x.shape[-1])
    return (sizes[0] in (1, batch) and sizes[-1] in (1, channels)
            and all(s == 1 for s in sizes[1:-1]))


class FuseAdalnModulation(GraphPass):
    name = "fuse_adaln_modulation"
    kernel_op = "kiln::layer_norm_modulate"
    description = "layer_norm(x) * scale + shift (per sample and channel) -> kiln::layer_norm_modulate"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        for norm in list(graph.nodes):
            if not is_call(norm, LAYER_NORM):
                continue
            mul = only_user(norm)
            if mul is None or not is_call(mul, MUL, ("mul",)) or mul.kwargs:
                continue
            scale = _other(mul, norm)
            add = only_user(mul)
            if scale is None or add is None or not is_call(add, ADD, ("add",)) or add.kwargs:
                continue
            shift = _other(add, mul)
            if shift is None:
                continue
            x = arg(norm, 0, "input")
            x_val, s_val, t_val, out_val = value(x), value(scale), value(shift), value(add)
            if None in (x_val, s_val, t_val, out_val) or not x_val.is_floating_point():
                result.skip("LayerNorm input, scale or shift is not a floating tensor")
                continue
            channels = size_expr(x_val.shape[-1])
            shape = arg(norm, 1, "normalized_shape")
            if not isinstance(shape, (tuple, list)) or len(shape) != 1 or shape[0] != channels:
                result.skip("LayerNorm over more than the last dimension")
                continue
            if not isinstance(channels, int) or channels > MAX_CHANNELS:
                result.skip(f"{channels} channels: the kernel takes up to {MAX_CHANNELS}, known at compile time")
                continue
            if not (_modulates_per_sample_channel(s_val, x_val) and _modulates_per_sample_channel(t_val, x_val)):
                result.skip("scale or shift is not per sample and channel (B, 1, C)")
                continue
            if out_val.dtype != out_dtype(x_val, s_val, t_val) or out_val.dim() != x_val.dim():
                result.skip("the modulated result's dtype or rank differs from the kernel's")
                continue
            if not kernel_gate(ctx, result, "LayerNorm+modulation", fast_mode_only=True):
                continue
            with graph.inserting_before(add):
                fused = graph.call_function(
                    torch.ops.kiln.layer_norm_modulate.default,
                    (x, arg(norm, 2, "weight"), arg(norm, 3, "bias"), float(arg(norm, 4, "eps", 1e-5)), scale, shift),
                )
            fused.meta.update(add.meta)
            add.replace_all_uses_with(fused)
            erase_unused(graph, add, mul, norm)
            result.rewrites += 1
