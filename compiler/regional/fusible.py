"""Whether a captured graph gives Inductor anything to fuse, and if not, why not.

Inductor speeds a graph up by fusing neighbouring elementwise and reduction ops into one generated
kernel. A block whose graph is one convolution (SD's Downsample2D) or one resize and a convolution
(Upsample2D) has nothing to fuse: the convolution runs the same library kernel compiled or not, and
one elementwise op alone is one kernel either way. Lowering such a graph still costs a C++ or Triton
build (a second or two each on a CPU) and every call pays the compiled code's entry and guards, so a
block region whose graph is one of these runs eagerly instead (compiler/regional/regional_compile.py), and says why.

With Kiln's cache on, the verdict is kept as a small record (`IdleRecord`) under the region's choice
key (compiler/cache/key.py `choice_fields`: the block's signature, its inputs' shapes, the lowering
options, the environment, Kiln's version), so a later start runs the region eagerly without capturing
it again. A stale record can only cost a fusion, never a wrong result: the block runs as it is.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..torch_compat import fx_graphs
from .region_choice import stored_record

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
IDLE_FILE = "region-nothing-to-fuse.json"  # the record's file in Kiln's cache
MAX_IDLE_RECORD_BYTES = 1024
MAX_IDLE_RECORD_OPS = len(LIBRARY_OPS) + MIN_FUSIBLE_OPS - 1  # the most a graph with nothing to fuse names
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


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
    value = fx_graphs.fake_value(node)
    if value is None:  # no record of what it made (a graph not from TorchDynamo): count it, the safe side
        return True
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) for v in values)


def idle_record(gm: torch.fx.GraphModule) -> Optional["IdleRecord"]:
    """`gm`'s verdict when lowering it gains nothing (fewer than MIN_FUSIBLE_OPS ops outside
    LIBRARY_OPS; its ops, each named once, in graph order), or None when Inductor has something to fuse."""
    ops = computing_ops(gm)
    fusible = [op for op in ops if op not in LIBRARY_OPS]
    if len(fusible) >= MIN_FUSIBLE_OPS:
        return None
    return IdleRecord(tuple(dict.fromkeys(ops)))


@dataclass(frozen=True)
class IdleRecord:
    """A region's graph had nothing for Inductor to fuse: the ops it computes."""

    ops: tuple[str, ...]

    def reason(self) -> str:
        return f"nothing for Inductor to fuse ({', '.join(self.ops) or 'no op'})"

    def to_bytes(self) -> bytes:
        return json.dumps({"ops": list(self.ops)}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "IdleRecord":
        """A stored record, read as untrusted data: ValueError naming the field when it is not one."""
        ops = stored_record(data, where, ("ops",), MAX_IDLE_RECORD_BYTES, "the record")["ops"]
        if not isinstance(ops, list) or len(ops) > MAX_IDLE_RECORD_OPS:
            raise ValueError(f"{where}: ops is not a list of at most {MAX_IDLE_RECORD_OPS} op names")
        for op in ops:
            if not isinstance(op, str) or not _OP_NAME.fullmatch(op):
                raise ValueError(f"{where}: ops holds {str(op)[:40]!r}, not an op name")
        if len(set(ops)) != len(ops):
            raise ValueError(f"{where}: ops names an op twice")
        if sum(op not in LIBRARY_OPS for op in ops) >= MIN_FUSIBLE_OPS:
            raise ValueError(f"{where}: ops names {MIN_FUSIBLE_OPS} or more ops Inductor could fuse")
        return cls(tuple(ops))
