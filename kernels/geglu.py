"""GEGLU: `a, gate = x.chunk(2, -1); a * gelu(gate)` in one pass (kiln::geglu).

x: (..., 2N) -> (..., N). Eager writes gelu(gate) and the product as two tensors; this kernel
reads x once and writes the product once, computing in fp32 for fp16/bf16 inputs.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._build import KernelBuild
from ._library import define_op, use_triton

BLOCK = 1024


def geglu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    a, gate = x.chunk(2, dim=-1)
    return a * F.gelu(gate, approximate=approximate)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _geglu_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride,
                      BLOCK: tl.constexpr, APPROX_TANH: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(x_ptr + row * x_row_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if APPROX_TANH:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            gelu = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))  # tanh(u) = 2 sigmoid(2u) - 1
        else:
            gelu = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        tl.store(out_ptr + row * out_row_stride + cols, (a * gelu).to(out_ptr.dtype.element_ty), mask=mask)

    return _geglu_kernel


def geglu_triton(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Launch the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    assert x.shape[-1] % 2 == 0, f"GEGLU needs an even last dim, got {tuple(x.shape)}"
    assert approximate in ("none", "tanh"), approximate
    n = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (rows.shape[0], (n + BLOCK - 1) // BLOCK)
        _kernels()[grid](rows, out, n, rows.stride(0), out.stride(0), BLOCK=BLOCK, APPROX_TANH=approximate == "tanh")
    return out.view(*x.shape[:-1], n)


def _geglu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return geglu_triton(x, approximate) if use_triton(x, "geglu") else geglu_ref(x, approximate)


def _geglu_fake(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


geglu_op = define_op("geglu", _geglu, _geglu_fake)


def geglu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return torch.ops.kiln.geglu(x, approximate)


def gpu_builds() -> list[KernelBuild]:
    """As launched: BLOCK=1024, Triton's default 4 warps, exact and tanh GELU, fp16/bf16/fp32 activations.
    The models' widths (n = 1280 to 5120) and row strides are multiples of 16, as are the pointers."""
    return [KernelBuild(f"geglu {dt} approximate={approximate} BLOCK={BLOCK}", _kernels(),
                        {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "n_cols": "i32", "x_row_stride": "i32",
                         "out_row_stride": "i32", "BLOCK": "constexpr", "APPROX_TANH": "constexpr"},
                        {"BLOCK": BLOCK, "APPROX_TANH": approximate == "tanh"},
                        aligned=("x_ptr", "out_ptr", "n_cols", "x_row_stride", "out_row_stride"))
            for dt in ("fp16", "bf16", "fp32") for approximate in ("none", "tanh")]
