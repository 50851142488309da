"""Per-token (row-wise) symmetric int8 quantization of activations (kiln::quantize_per_token).

x (M, K) float -> (x_int8 (M, K) int8, scale (M,) float32): scale = max(amax(|row|) / 127, 1e-12),
x_int8 = round(x / scale) (ties to even, like torch.round) clamped to [-127, 127]. An all-zero row
gets scale 1e-12 and zeros. Used by kiln::int8_dynamic_linear (W8A8) before its int8 GEMM.

Triton kernel: one program per row, two passes over K in blocks (the row's amax, then quantize;
the second read of a row of at most a few KiB comes from L2). Eager torch makes an fp32 copy, an
abs, a reduction, a division and a rounding, each a full pass with its own intermediate tensor.
Runs on CUDA with Triton for fp16/bf16/fp32 x, else the torch reference.
"""
from __future__ import annotations

import functools

import torch

from .._build import KernelBuild
from .._library import define_op, use_triton
from ._gemm import EPS, INT8_MAX, interpreting, triton_dtype

BLOCK_K = 1024
NUM_WARPS = 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2, f"quantize_per_token takes (M, K), got {tuple(x.shape)}"
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / INT8_MAX).clamp_min(EPS) if x.shape[1] else xf.new_full((x.shape[0],), EPS)
    q = torch.round(xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _kernels():
    """The @triton.jit kernel, built once per interpreter setting (TRITON_INTERPRET=1 makes
    @triton.jit give an interpreted function; the GPU build check needs the real JITFunction)."""
    return _build_kernels(interpreting())


@functools.lru_cache(maxsize=None)
def _build_kernels(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, eps,
                                   BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xm
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), eps)
        tl.store(scale_ptr + row, scale)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = tl.math.div_rn(v, scale)  # IEEE division, as the reference's x / scale
            r = tl.floor(q + 0.5)  # exact for |q| < 2^22; then ties to even, like torch.round
            r = tl.where((r - q == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            tl.store(q_ptr + row * stride_qm + cols, r.to(tl.int8), mask=cols < K)

    return _quantize_per_token_kernel


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    assert x.dim() == 2, f"quantize_per_token takes (M, K), got {tuple(x.shape)}"
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _kernels()[(M,)](x, q, scale, K, x.stride(0), q.stride(0), EPS, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return q, scale


def gpu_builds() -> list[KernelBuild]:
    fn = _kernels()
    return [KernelBuild(name=f"quantize_per_token {triton_dtype(dt)} BLOCK_K={BLOCK_K}", fn=fn,
                        signature={"x_ptr": f"*{triton_dtype(dt)}", "q_ptr": "*i8", "scale_ptr": "*fp32", "K": "i32",
                                   "stride_xm": "i32", "stride_qm": "i32", "eps": "fp32", "BLOCK_K": "constexpr"},
                        constexprs={"BLOCK_K": BLOCK_K}, num_warps=NUM_WARPS, num_stages=1,
                        aligned=("x_ptr", "q_ptr", "K", "stride_xm", "stride_qm"))
            for dt in DTYPES]


def _quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x, "quantize_per_token") and x.dtype in DTYPES:
        return quantize_per_token_triton(x)
    return quantize_per_token_ref(x)


def _quantize_per_token_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(x.dim() == 2, lambda: f"quantize_per_token takes (M, K), got {x.dim()} dims")
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


quantize_per_token_op = define_op("quantize_per_token", _quantize_per_token, _quantize_per_token_fake)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.kiln.quantize_per_token(x)
