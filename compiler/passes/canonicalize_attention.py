"""canonicalize_attention: hand-written attention -> `scaled_dot_product_attention`.

Matches `softmax(scale * q @ k^T, dim=-1) @ v` however a model spells it:
- scores: `torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=scale)` (diffusers'
  `AttnProcessor`), `q @ k.transpose(-1, -2)`, `torch.bmm`/`torch.matmul`, or
  `einsum("b i d, b j d -> b i j", q, k)` (ComfyUI's `attention_basic`), with an optional
  `* scale` / `/ scale` after it;
- optional dtype casts around the softmax (`.float()`, `.to(dtype)`: upcast softmax);
- `probs @ v` by bmm/matmul/`@`, or `einsum("b i j, b j d -> b i d", probs, v)`.
SDPA dispatches to flash / memory-efficient / cuDNN kernels (never materialising the L x S
score matrix), so this is always worth doing; no attention mask or dropout is matched.
"""
from __future__ import annotations

import math
import numbers
import operator

import torch
import torch.nn.functional as F

from .base import DIV, MUL, GraphPass, PassContext, PassResult, arg, erase_unused, is_call, only_user, value

SOFTMAX = (torch.softmax, F.softmax)
MATMUL = (torch.matmul, torch.bmm, operator.matmul)
CASTS = ("float", "to", "type", "half", "bfloat16")


def pattern_attention(q, k, v, scale: float = 0.125):
    return (torch.bmm(q, k.transpose(-1, -2)) * scale).softmax(dim=-1) @ v


def replacement_attention(q, k, v, scale: float = 0.125):
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def example_inputs():
    return (torch.randn(6, 11, 8), torch.randn(6, 13, 8), torch.randn(6, 13, 5))


def _einsum_spec(node) -> str:
    return "".join(str(node.args[0]).split()) if node.args and isinstance(node.args[0], str) else ""


def _untransposed(kt):
    """k for a node computing k^T over the last two dims, else None."""
    if not isinstance(kt, torch.fx.Node):
        return None
    if kt.op == "call_method" and kt.target == "transpose" or kt.op == "call_function" and kt.target is torch.transpose:
        dims = tuple(kt.args[1:3])
        kv = value(kt.args[0])
        if kv is None:
            return None
        last_two = {kv.dim() - 2, kv.dim() - 1}
        if {d % kv.dim() for d in dims if isinstance(d, int)} == last_two and len(dims) == 2:
            return kt.args[0]
    return None


def _scores(node):
    """(q, k, scale, nodes consumed) if `node` computes scale * q @ k^T, else None."""
    scale, consumed = 1.0, []
    # a trailing `* scale` or `/ scale` by a Python number
    if is_call(node, MUL, ("mul",)) or is_call(node, DIV, ("div",)):
        lhs, rhs = node.args[:2]
        if isinstance(rhs, numbers.Real) and isinstance(lhs, torch.fx.Node):
            factor, inner = rhs, lhs
        elif isinstance(lhs, numbers.Real) and isinstance(rhs, torch.fx.Node) and is_call(node, MUL, ("mul",)):
            factor, inner = lhs, rhs
        else:
            return None
        scale = float(factor) if is_call(node, MUL, ("mul",)) else 1.0 / float(factor)
        consumed.append(node)
        if only_user(inner) is not node:
            return None
        node = inner
    if is_call(node, (torch.baddbmm,), ("baddbmm",)):
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if beta != 0 or not isinstance(alpha, numbers.Real):
            return None
        k = _untransposed(node.args[2])
        if k is None:
            return None
        return node.args[1], k, scale * float(alpha), consumed + [node, node.args[2], node.args[0]]
    if is_call(node, MATMUL, ("matmul", "bmm")):
        k = _untransposed(node.args[1])
        return None if k is None else (node.args[0], k, scale, consumed + [node, node.args[1]])
    if is_call(node, (torch.einsum,)) and len(node.args) == 3:
        spec = _einsum_spec(node)
        lhs, out = spec.split("->") if "->" in spec else ("", "")
        ins = lhs.split(",")
        # q: (..., i, d), k: (..., j, d) -> (..., i, j), batch letters shared
        if len(ins) == 2 and len(ins[0]) == len(ins[1]) >= 2:
            (*bq, i, d), (*bk, j, d2) = ins
            if bq == bk and d == d2 and out == "".join(bq) + i + j:
                return node.args[1], node.args[2], scale, consumed + [node]
    return None


def _probs_times_v(probs):
    """(v, output node, casts consumed) if probs (after optional casts) is multiplied by v."""
    casts = []
    node = probs
    while (user := only_user(node)) is not None and is_call(user, (), CASTS):
        casts.append(user)
        node = user
    out = only_user(node)
    if out is None:
        return None
    if is_call(out, MATMUL, ("matmul", "bmm")) and out.args[0] is node:
        return out.args[1], out, casts
    if is_call(out, (torch.einsum,)) and len(out.args) == 3 and out.args[1] is node:
        lhs, res = _einsum_spec(out).split("->") if "->" in _einsum_spec(out) else ("", "")
        ins = lhs.split(",")
        if len(ins) == 2 and len(ins[0]) == len(ins[1]) >= 2:
            (*bp, i, j), (*bv, j2, d) = ins
            if bp == bv and j == j2 and res == "".join(bp) + i + d:
                return out.args[2], out, casts
    return None


class CanonicalizeAttention(GraphPass):
    name = "canonicalize_attention"
    description = "softmax(q @ k^T * scale) @ v -> scaled_dot_product_attention"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        for softmax in list(graph.nodes):
            if not is_call(softmax, SOFTMAX, ("softmax",)):
                continue
            logits = softmax.args[0] if softmax.args else softmax.kwargs.get("input")
            dim = arg(softmax, 1, "dim")
            lv = value(logits)
            if lv is None or dim not in (-1, lv.dim() - 1):
                continue
            chain = [softmax]  # softmax, then the casts before it, walking back to the scores
            while is_call(logits, (), CASTS) and only_user(logits) is chain[-1]:
                chain.append(logits)
                logits = logits.args[0]
            if not isinstance(logits, torch.fx.Node) or only_user(logits) is not chain[-1]:
                continue
            pre_casts = chain[1:]
            scores = _scores(logits)
            pv = _probs_times_v(softmax)
            if scores is None or pv is None:
                continue
            q, k, scale, score_nodes = scores
            v, out, post_casts = pv
            qv, kv, vv, ov = value(q), value(k), value(v), value(out)
            if None in (qv, kv, vv, ov):
                result.skip("attention operands without recorded shapes")
                continue
            if not (qv.dtype == kv.dtype == vv.dtype == ov.dtype) or qv.dim() < 2:
                result.skip(f"mixed dtypes q={qv.dtype} k={kv.dtype} v={vv.dtype} out={ov.dtype}")
                continue
            if ctx.switch == "off":
                continue
            default_scale = 1.0 / math.sqrt(qv.shape[-1])
            kwargs = {} if math.isclose(scale, default_scale, rel_tol=1e-6) else {"scale": scale}
            with graph.inserting_before(out):
                sdpa = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
            sdpa.meta.update(out.meta)
            out.replace_all_uses_with(sdpa)
            erase_unused(graph, out, *reversed(post_casts), softmax, *pre_casts, *score_nodes)
            result.rewrites += 1
