"""choose_attention_backend: `scaled_dot_product_attention` -> the backend measured fastest for its shape.

SDPA picks its kernel by fixed rules at every call (flash where it can, then memory-efficient, ...),
the same on every GPU and at every shape. Attention is most of SDXL's step at 1024 and about a fifth
of Flux's FLOPs, and which of flash, cuDNN and memory-efficient wins depends on the GPU, the head
size and the token counts. So on CUDA each plain attention call (no mask, no dropout, not causal, as
many key as query heads) is measured once a process per shape among the candidates
(compiler/attention/choice.py: a fidelity check against float32 math first, then the GPU's own time)
and its node calls the winner's aten op (compiler/torch_compat/sdpa_backends.py), which Inductor
lowers to the same library kernel. The choice is said in the log and kept in the compile's record
(`GraphCompile.notes`, with the region). With a dynamic graph the shape measured is the capture's
(its sizes' hints); other sizes run the same backend.

On a CPU nothing changes: the pass stands aside (force with `passes: {choose_attention_backend: on}`,
which there measures among the backends a CPU runs: math). With autograd on it stands aside (the
choice is made for inference).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..attention.backends import BY_NAME, run_external
from ..attention.choice import AttentionKey, chosen_for
from ..torch_compat import sdpa_backends
from ..torch_compat.fx_graphs import outside_fake_mode, size_hint
from .base import GraphPass, PassContext, PassResult, arg, value

SDPA = (F.scaled_dot_product_attention,)


def pattern_attention_backend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=0.125)


def replacement_attention_backend(q, k, v):
    return sdpa_backends.run_sdpa("math", q, k, v, 0.125)  # on a CPU, forced on: math is the only candidate


def example_inputs():
    return (torch.randn(2, 3, 11, 8), torch.randn(2, 3, 13, 8), torch.randn(2, 3, 13, 8))


def _plain(node: torch.fx.Node) -> str:
    """Why this SDPA call is not one the choice covers ('' when it is)."""
    if arg(node, 3, "attn_mask") is not None:
        return "it has an attention mask"
    if arg(node, 4, "dropout_p", 0.0) != 0.0:
        return "it has dropout"
    if arg(node, 5, "is_causal", False) is not False:
        return "it is causal"
    if node.kwargs.get("enable_gqa", False) is not False:
        return "it groups query heads"
    scale = node.kwargs.get("scale")
    if not (scale is None or isinstance(scale, (int, float))):
        return "its scale is not a constant"
    return ""


def attention_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The choice's key for fake q, k, v of (batch, heads, tokens, dim), or of (batch x heads, tokens, dim)
    as canonicalised hand-written attention has them (one head each), sizes by their hints; None when
    they are not such (other ranks, heads or batches that differ, dtypes that differ)."""
    if any(t is None for t in (q, k, v)) or not q.dim() == k.dim() == v.dim() or q.dim() not in (3, 4) \
            or not q.dtype == k.dtype == v.dtype:
        return None

    def sizes(t: torch.Tensor) -> list[int]:
        shape = [size_hint(n) for n in t.shape]
        return shape if t.dim() == 4 else [shape[0], 1, *shape[1:]]

    (b, h, lq, d), (bk, hk, s, dk), (bv, hv, sv, dv) = sizes(q), sizes(k), sizes(v)
    if not (b == bk == bv and h == hk == hv and s == sv and d == dk):
        return None
    return AttentionKey(b, h, lq, s, d, dv, q.dtype)


class ChooseAttentionBackend(GraphPass):
    name = "choose_attention_backend"
    description = "scaled_dot_product_attention -> the SDPA backend measured fastest for its shape (CUDA)"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in SDPA:
                continue
            why = _plain(node)
            if why:
                result.skip(f"attention: {why}; SDPA picks its kernel")
                continue
            if ctx.grad_enabled:
                result.skip("attention: autograd is enabled (the choice is made for inference)")
                continue
            if ctx.switch != "on" and ctx.device_type != "cuda":
                result.skip(f"attention: {ctx.device_type}: SDPA picks its kernel; the choice is measured on CUDA "
                            "(force with passes: on)")
                continue
            q, k, v = (arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
            key = attention_key(value(q), value(k), value(v))
            if key is None:
                result.skip("attention: q, k and v are not (batch, heads, tokens, dim) of one batch, head count and dtype")
                continue
            scale = node.kwargs.get("scale")
            scale = None if scale is None else float(scale)
            try:
                with outside_fake_mode():
                    choice = chosen_for(key, value(q).device, scale, in_graph_only=ctx.inductor)
            except RuntimeError as exc:
                result.skip(f"attention: {exc}")
                continue
            with graph.inserting_before(node):
                three_d = value(q).dim() == 3  # the backends' ops take (batch, heads, tokens, dim): one head
                if three_d:
                    q, k, v = (graph.call_method("unsqueeze", (t, 1)) for t in (q, k, v))
                if BY_NAME[choice.backend].in_graph:
                    op, args, kwargs = sdpa_backends.sdpa_call(choice.backend, q, k, v, scale)
                    out = graph.call_function(operator.getitem, (graph.call_function(op, args, kwargs), 0))
                else:
                    out = graph.call_function(run_external, (choice.backend, q, k, v, scale))
                if three_d:
                    out = graph.call_method("squeeze", (out, 1))
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            result.rewrites += 1
            result.note(choice.line())
