"""W8A8 Linear: int8 weights and int8 activations quantized per token at run time
(kiln::int8_dynamic_linear), over an int8 x int8 -> int32 GEMM with a scaling epilogue (kiln::int8_mm_scaled).

Why it is still a custom op: Kiln's int8_dynamic layers run rowwise_linear.py (the same math in
traceable torch ops over torch._int_mm) wherever torch._int_mm takes the layer (the CPU; CUDA with K and
N multiples of 8). This op serves CUDA layers with other K or N, through its Triton GEMM (which takes
any shape), and it is the autotuned Triton GEMM that torch._int_mm is measured against.

    int8_dynamic_linear(x (..., K) float, weight (N, K) int8, weight_scale (N,) float32, bias (N,) | None)
        -> (..., N) in x.dtype
        = int8_mm_scaled(*quantize_per_token(x.reshape(-1, K)), weight, weight_scale, bias, x.dtype)
    int8_mm_scaled(xq (M, K) int8, x_scale (M,) float32, wq (N, K) int8, w_scale (N,) float32,
                   bias (N,) | None, out_dtype) -> (M, N) out_dtype
        = float32(xq @ wq.T, exact in int32) * x_scale[:, None] * w_scale[None, :] + bias

The Triton kernel (`_int8_mm_scaled_kernel`) runs tl.dot on int8 tiles into an int32 accumulator
(int8 tensor cores: mma on sm_80/89, wgmma on sm_90) and applies both scales and the bias in
the epilogue, computing as the reference does (int32 -> fp32, times x_scale, times w_scale, plus
bias), so under the interpreter the two agree bit for bit. Autotuned over INT8_CONFIGS keyed on
(N, K); each config's shared memory fits sm_89's 99 KiB.

Which path runs where:
    CUDA, Triton, fp16/bf16 out    quantize_per_token's Triton kernel, then the Triton int8 GEMM.
    anywhere else                  the reference: torch._int_mm (CPU: any shape; CUDA: M > 16 and
                                   K, N multiples of 8) for the exact int32 product, else an fp64
                                   matmul (exact: |sum| <= K * 127^2 < 2^53), then the epilogue in torch.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .._build import KernelBuild
from .._library import define_op, log_once, use_triton
from ._gemm import GemmConfig, autotuned, cdiv, interpreting, triton_dtype
from .quantize_per_token import quantize_per_token_ref

# int8 x int8 tiles per stage (A100/H100; every one within sm_89's 99 KiB of shared memory)
INT8_CONFIGS = [
    GemmConfig(128, 128, 64, 8, 4),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 64, 128, 4, 4),
    GemmConfig(64, 64, 128, 4, 4),
]
OUT_DTYPES = (torch.float16, torch.bfloat16)  # what the Triton path stores on CUDA


def int32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) int8 @ b (N, K).T int8 -> (M, N) int32, exact."""
    M, K = a.shape
    N = b.shape[0]
    if not (M and N and K):
        return torch.zeros(M, N, dtype=torch.int32, device=a.device)
    if a.device.type == "cpu" or (a.device.type == "cuda" and M > 16 and K % 8 == 0 and N % 8 == 0):
        return torch._int_mm(a.contiguous(), b.contiguous().t())
    log_once("int32_mm fp64", f"kiln: an int8 GEMM of shape ({M}, {K}) x ({K}, {N}) on {a.device.type} "
             "has no torch._int_mm kernel; it runs as an fp64 matmul (exact, slow)")
    return (a.double() @ b.double().t()).to(torch.int32)


def int8_mm_scaled_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = int32_mm(xq, wq).float() * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def int8_dynamic_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    K = x.shape[-1]
    xq, x_scale = quantize_per_token_ref(x.reshape(-1, K))
    out = int8_mm_scaled_ref(xq, x_scale, weight, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def _kernels():
    """The @triton.jit kernel and its autotuned wrapper, built once per interpreter setting
    (TRITON_INTERPRET=1 makes @triton.jit give an interpreted function; the GPU build check needs
    the real JITFunction)."""
    return _build_kernels(interpreting())


@functools.lru_cache(maxsize=None)
def _build_kernels(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def _int8_mm_scaled_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, M, N, K,
                               stride_am, stride_bn, stride_om,
                               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # a (M, K) and b (N, K) int8 with unit stride along K (the launcher makes sure); out (M, N) packed.
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group_size = GROUP_M * num_pid_n
        first_m = (pid // group_size) * GROUP_M
        rows_in_group = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group_size) % rows_in_group
        pid_n = (pid % group_size) // rows_in_group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = (offs_m % M).to(tl.int64)  # wrapped, so the loads need no M or N mask; the store is masked
        rn = (offs_n % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + rn[None, :] * stride_bn + offs_k[:, None]  # a (BLOCK_K, BLOCK_N) tile of B^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        out = acc.to(tl.float32) * tl.load(a_scale_ptr + rm)[:, None] * tl.load(b_scale_ptr + rn)[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    return _int8_mm_scaled_kernel, autotuned(_int8_mm_scaled_kernel, INT8_CONFIGS, interpret)


def int8_mm_scaled_triton(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Launch the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    M, K = xq.shape
    N = wq.shape[0]
    assert xq.dtype == wq.dtype == torch.int8, f"int8_mm_scaled takes int8 operands, got {xq.dtype}, {wq.dtype}"
    assert wq.shape == (N, K), f"wq must be (N, {K}), got {tuple(wq.shape)}"
    assert x_scale.shape == (M,) and w_scale.shape == (N,), f"scales must be ({M},) and ({N},)"
    assert bias is None or bias.shape == (N,), f"bias must be ({N},), got {tuple(bias.shape)}"
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    wq = wq if wq.stride(-1) == 1 else wq.contiguous()
    x_scale = x_scale.to(torch.float32).contiguous()
    w_scale = w_scale.to(torch.float32).contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if out.numel():
        _, kernel = _kernels()
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        kernel[grid](xq, wq, x_scale, w_scale, w_scale if bias is None else bias.contiguous(), out, M, N, K,
                     xq.stride(0), wq.stride(0), out.stride(0), HAS_BIAS=bias is not None)
    return out


def int8_dynamic_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quantize_per_token's Triton kernel, then the int8 GEMM's (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from .quantize_per_token import quantize_per_token_triton

    K = x.shape[-1]
    xq, x_scale = quantize_per_token_triton(x.reshape(-1, K))
    return int8_mm_scaled_triton(xq, x_scale, weight, weight_scale, bias, x.dtype).view(*x.shape[:-1], weight.shape[0])


def _int8_mm_scaled(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype in OUT_DTYPES and use_triton(xq, "int8_mm_scaled"):
        return int8_mm_scaled_triton(xq, x_scale, wq, w_scale, bias, out_dtype)
    return int8_mm_scaled_ref(xq, x_scale, wq, w_scale, bias, out_dtype)


def _int8_mm_scaled_fake(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    torch._check(xq.dim() == 2 and wq.dim() == 2 and wq.shape[1] == xq.shape[1],
                 lambda: f"int8_mm_scaled takes (M, K) and (N, K), got {tuple(xq.shape)} and {tuple(wq.shape)}")
    return xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype)


int8_mm_scaled_op = define_op("int8_mm_scaled", _int8_mm_scaled, _int8_mm_scaled_fake)


def _int8_dynamic_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    K = x.shape[-1]
    xq, x_scale = torch.ops.kiln.quantize_per_token(x.reshape(-1, K))
    out = torch.ops.kiln.int8_mm_scaled(xq, x_scale, weight, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def _int8_dynamic_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    torch._check(weight.dim() == 2 and weight.shape[1] == x.shape[-1],
                 lambda: f"weight must be (N, {x.shape[-1]}), got {tuple(weight.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


int8_dynamic_linear_op = define_op("int8_dynamic_linear", _int8_dynamic_linear, _int8_dynamic_linear_fake)


def int8_mm_scaled(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ops.kiln.int8_mm_scaled(xq, x_scale, wq, w_scale, bias, out_dtype)


def int8_dynamic_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.ops.kiln.int8_dynamic_linear(x, weight, weight_scale, bias)


def gpu_builds() -> list[KernelBuild]:
    """One build per autotune config and output dtype (fp16, bf16)."""
    fn, _ = _kernels()
    return [KernelBuild(
        name=f"int8_mm_scaled i8 -> {triton_dtype(dt)} {cfg.name}", fn=fn,
        signature={"a_ptr": "*i8", "b_ptr": "*i8", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
                   "bias_ptr": f"*{triton_dtype(dt)}", "out_ptr": f"*{triton_dtype(dt)}", "M": "i32", "N": "i32",
                   "K": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr"},
        constexprs={"HAS_BIAS": True, **cfg.constexprs()}, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        aligned=ALIGNED)
        for cfg in INT8_CONFIGS for dt in OUT_DTYPES]


# what Triton specialises a real layer's launch on: 16-byte aligned tensors, N, K and row strides divisible by 16
ALIGNED = ("a_ptr", "b_ptr", "a_scale_ptr", "b_scale_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_am", "stride_bn",
           "stride_om")
