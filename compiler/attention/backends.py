"""The attention kernels a shape's choice is made among, each with where it runs and how it is called.

SDPA's own backends (flash, cuDNN, memory-efficient, math) are called through their aten ops
(compiler/torch_compat/sdpa_backends.py), so a graph lowered by Inductor can hold them (`in_graph`).
External kernels join only where their package is importable: FlashAttention 3 (`flash_attn_interface`,
Hopper) and SageAttention (`sageattention`). They are Python calls Inductor cannot trace, so they are
chosen only where no Inductor lowers the graph (mode fast). A backend that cannot run a shape (head
size, dtype, GPU) raises, and the choice leaves it out, saying why.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..torch_compat.sdpa_backends import run_sdpa

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float]], torch.Tensor]  # q, k, v (B, H, L, D), scale


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    devices: frozenset        # device types it runs on
    in_graph: bool            # an aten op Inductor lowers; else a Python call (mode fast only)
    run: Attention
    module: str = ""          # the package it needs ('' for torch's own)

    def missing(self) -> str:
        """Why it cannot be a candidate in this process ('' when it can): its package is not installed."""
        if self.module and importlib.util.find_spec(self.module) is None:
            return f"{self.module} is not installed"
        return ""


def _sdpa(name: str) -> Attention:
    return lambda q, k, v, scale: run_sdpa(name, q, k, v, scale)


def _fa3(q, k, v, scale):
    """FlashAttention 3 takes (B, L, H, D) and may return (out, lse)."""
    out = importlib.import_module("flash_attn_interface").flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def _sage(q, k, v, scale):
    sageattn = importlib.import_module("sageattention").sageattn
    return sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale)


CUDA = frozenset({"cuda"})
# the candidates, in the order they are tried; math is the fidelity reference and runs everywhere
BACKENDS: tuple[AttentionBackend, ...] = (
    AttentionBackend("flash", CUDA, True, _sdpa("flash")),
    AttentionBackend("cudnn", CUDA, True, _sdpa("cudnn")),
    AttentionBackend("efficient", CUDA, True, _sdpa("efficient")),
    AttentionBackend("math", frozenset({"cuda", "cpu"}), True, _sdpa("math")),
    AttentionBackend("fa3", CUDA, False, _fa3, module="flash_attn_interface"),
    AttentionBackend("sage", CUDA, False, _sage, module="sageattention"),
)
BY_NAME = {backend.name: backend for backend in BACKENDS}


def run_external(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """An external backend's call, as a graph run without Inductor holds it."""
    return BY_NAME[name].run(q, k, v, scale)
