"""Whether a captured graph gives Inductor anything to fuse, and if not, why not.

Inductor speeds a graph up by fusing neighbouring elementwise and reduction ops into one generated
kernel. A block whose graph is one convolution (SD's Downsample2D) or one resize and a convolution
(Upsample2D) has nothing to fuse: the convolution runs the same library kernel compiled or not, and
one elementwise op alone is one kernel either way. Lowering such a graph still costs a C++ or Triton
build (a second or two each on a CPU) and every call pays the compiled code's entry and guards, so a
block region whose graph is one of these runs eagerly instead (compiler/regional.py), and says why.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import compat

# ops that run a library kernel (oneDNN, cuBLAS, cuDNN, flash attention) whether compiled or not
LIBRARY_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "scaled_dot_product_attention",
})
# ops that only describe a tensor or view it differently: no kernel, nothing computed
VIEW_OPS = frozenset({
    "getitem", "getattr", "size", "dim", "stride", "view", "reshape", "permute", "transpose", "t", "flatten",
    "unflatten", "unsqueeze", "squeeze", "expand", "narrow", "chunk", "split", "unbind", "contiguous",
})
MIN_FUSIBLE_OPS = 2  # fusing needs two ops at least


def op_name(node: torch.fx.Node) -> str:
    """'conv2d', 'silu', 'add', 'view', ... for a call node of a TorchDynamo graph."""
    target = node.target
    if isinstance(target, str):  # call_method: the method's name
        return target
    return getattr(target, "__name__", str(target)).lstrip("_")


def computing_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The names of the graph's calls that compute a tensor, in graph order: views and the arithmetic
    on sizes that dynamic shapes add (`sym_size`, `mul` of two SymInts) are left out."""
    return [op_name(n) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module") and op_name(n) not in VIEW_OPS
            and _makes_tensor(n)]


def _makes_tensor(node: torch.fx.Node) -> bool:
    value = compat.fake_value(node)
    if value is None:  # no record of what it made (a graph not from TorchDynamo): count it, the safe side
        return True
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) for v in values)


def nothing_to_fuse(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why lowering `gm` gains nothing (fewer than MIN_FUSIBLE_OPS ops outside LIBRARY_OPS), or None
    when Inductor has something to fuse."""
    ops = computing_ops(gm)
    fusible = [op for op in ops if op not in LIBRARY_OPS]
    if len(fusible) >= MIN_FUSIBLE_OPS:
        return None
    shown = ", ".join(dict.fromkeys(ops)) or "no op"
    return f"nothing for Inductor to fuse ({shown})"
