"""SDPA's backends called one by one: the private aten ops `scaled_dot_product_attention` dispatches to.

`F.scaled_dot_product_attention` picks its kernel itself, by fixed rules, at every call. To run the
backend Kiln measured fastest for a shape (compiler/attention/), a graph calls that backend's own aten
op, which TorchDynamo, AOTAutograd and Inductor all know (Inductor runs it as the same library kernel).
No global switch is set (`torch.nn.attention.sdpa_kernel` sets process-wide flags, which a lowering
thread would change under the model's own calls).

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against (these schemas: torch 2.5 - 2.13)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# backend -> (aten op name, the arguments after q, k, v for no mask, no dropout, not causal); output 0 is the attention
SDPA_OPS: dict[str, tuple[str, tuple]] = {
    "flash": ("_scaled_dot_product_flash_attention", (0.0, False, False)),
    "efficient": ("_scaled_dot_product_efficient_attention", (None, False, 0.0, False)),
    "cudnn": ("_scaled_dot_product_cudnn_attention", (None, False, 0.0, False, False)),
    "math": ("_scaled_dot_product_attention_math", (None, 0.0, False, None)),
}


def sdpa_call(backend: str, q: Any, k: Any, v: Any, scale: Optional[float]) -> tuple[Callable, tuple, dict]:
    """(op, args, kwargs) calling SDPA backend `backend` on q, k, v (tensors, or FX nodes for a graph); the
    op returns a tuple whose element 0 is the attention."""
    name, rest = SDPA_OPS[backend]
    return getattr(torch.ops.aten, name).default, (q, k, v, *rest), {"scale": scale}


def run_sdpa(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    op, args, kwargs = sdpa_call(backend, q, k, v, scale)
    return op(*args, **kwargs)[0]
