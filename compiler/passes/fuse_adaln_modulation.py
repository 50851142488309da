"""fuse_adaln_modulation: `layer_norm(x) * scale + shift` -> one Kiln kernel (kiln::layer_norm_modulate).

AdaLN in every DiT block (SD3 and Flux in diffusers and ComfyUI, PixArt): normalise the tokens,
then modulate per sample and channel, `norm(x) * (1 + scale[:, None]) + shift[:, None]`. Eager
makes three passes over the activation (two with ComfyUI's `addcmul(shift, norm(x), 1 + scale)`);
the kernel makes one. The multiplier is taken as the graph computes it (the `1 + scale` on the
small (B, C) tensor stays where it is).

Inductor fuses the same norm and modulation, together with the residual add before them, so in
modes balanced and max "auto" leaves it to Inductor; the kernel serves mode fast (no Inductor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels  # noqa: F401  (registers torch.ops.kiln.*)
from ...kernels.layer_norm_modulate import MAX_CHANNELS, modulates_per_sample_channel, out_dtype
from ..torch_compat.fx_graphs import size_expr
from .base import ADD, MUL, GraphPass, PassContext, PassResult, arg, erase_unused, is_call, kernel_gate, only_user, value

LAYER_NORM = (F.layer_norm, torch.layer_norm)
ADDCMUL = (torch.addcmul,)


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


def _modulation_of(norm: torch.fx.Node):
    """(scale, shift, last node, middle node or None) if the norm's only use is `norm * scale + shift`,
    in either operand order, or ComfyUI's `addcmul(shift, norm, scale)`; else None."""
    user = only_user(norm)
    if user is None:
        return None
    if is_call(user, ADDCMUL, ("addcmul",)) and user.kwargs.get("value", 1) == 1 and len(user.args) == 3:
        shift, t1, t2 = user.args
        scale = t2 if t1 is norm else t1 if t2 is norm else None
        if isinstance(scale, torch.fx.Node) and isinstance(shift, torch.fx.Node) and norm not in (scale, shift):
            return scale, shift, user, None
        return None
    if not is_call(user, MUL, ("mul",)) or user.kwargs:
        return None
    scale, add = _other(user, norm), only_user(user)
    if scale is None or add is None or not is_call(add, ADD, ("add",)) or add.kwargs:
        return None
    shift = _other(add, user)
    return (scale, shift, add, user) if shift is not None else None


def _modulates_per_sample_channel(t: torch.Tensor, x: torch.Tensor) -> bool:
    """On the fake tensors' size expressions: a symbolic batch matches itself, nothing is guarded."""
    return modulates_per_sample_channel([size_expr(s) for s in t.shape], [size_expr(s) for s in x.shape])


class FuseAdalnModulation(GraphPass):
    name = "fuse_adaln_modulation"
    kernel_op = "kiln::layer_norm_modulate"
    description = "layer_norm(x) * scale + shift (per sample and channel) -> kiln::layer_norm_modulate"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        for norm in list(graph.nodes):
            if not is_call(norm, LAYER_NORM):
                continue
            match = _modulation_of(norm)
            if match is None:
                continue
            scale, shift, last, middle = match
            x = arg(norm, 0, "input")
            x_val, s_val, t_val, out_val = value(x), value(scale), value(shift), value(last)
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
            if not kernel_gate(ctx, result, "LayerNorm+modulation", without_inductor_only=True):
                continue
            with graph.inserting_before(last):
                fused = graph.call_function(
                    torch.ops.kiln.layer_norm_modulate.default,
                    (x, arg(norm, 2, "weight"), arg(norm, 3, "bias"), float(arg(norm, 4, "eps", 1e-5)), scale, shift),
                )
            fused.meta.update(last.meta)
            last.replace_all_uses_with(fused)
            erase_unused(graph, last, middle, norm)
            result.rewrites += 1
