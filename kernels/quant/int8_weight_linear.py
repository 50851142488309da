"""Weight-only int8 Linear (kiln::int8_weight_linear): int8 weights, activations in high precision;
one Triton GEMM dequantizes the weight tile as it loads it. fp8_weight_linear.py runs the same
kernel on float8 e4m3 weights.

    int8_weight_linear(x (..., K) float, weight (N, K) int8, scale (N,) | () | (1,) float32, bias (N,) | None)
        -> (..., N) in x.dtype = (x @ weight.T) * scale + bias

The scale is per output channel (Kiln's int8_weight) or one per tensor (ComfyUI's int8_tensorwise).

The kernel (`_weight_only_linear_kernel`) loads an int8 or fp8 (BLOCK_K, BLOCK_N) tile of W^T,
converts it to x's dtype (exact: |int8| <= 127 and every e4m3 value fit fp16 and bf16), runs
tl.dot into an fp32 accumulator, and in the epilogue multiplies by the scale (per channel or per
tensor), adds the bias and stores x's dtype. No dequantized weight is ever written to memory.
It is autotuned over WEIGHT_ONLY_CONFIGS keyed on (N, K); each config's shared memory fits sm_89's
99 KiB (checked by compiling every entry of gpu_builds(): int8 storage with a per-channel and a
per-tensor scale, fp8 with a per-tensor one).

Which path runs where (`int8_path` decides; a fallback says so once in the log):
    CPU (any dtype)                    reference: dequantize to fp32, F.linear in fp32, cast back.
    CUDA, fp16/bf16 x, Triton          the Triton kernel.
    CUDA, fp32 x or no Triton          dequantize the weight to x's dtype, then F.linear (cuBLAS;
                                       one weight-sized temporary per call).

Why not `torch._weight_int8pack_mm` as the CPU fast path: measured in this torch (2.13, CPU
capability AVX2), bf16 x with K not a multiple of 16 segfaults (x (5, 33), w (7, 33)) or returns
garbage without an error (x (1, 33): relative error 3.6e13); with ATEN_CPU_CAPABILITY=default the
same call is right. Which kernel runs depends on the user's CPU, so no shape guard tested on one
machine proves it safe on another, and it also wants the scale in x's dtype. Kiln's CPU path is
the fp32 reference.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .._build import KernelBuild
from .._library import define_op, log_once, use_triton
from ._gemm import GemmConfig, autotuned, cdiv, interpreting, triton_dtype

# Sensible for A100/H100 (and the 99 KiB of an sm_89 card): fp16/bf16 x tile plus an 8-bit weight tile per stage.
WEIGHT_ONLY_CONFIGS = [
    GemmConfig(128, 128, 64, 8, 3),
    GemmConfig(128, 64, 64, 4, 4),
    GemmConfig(64, 128, 64, 8, 4),  # 4 warps spill 8 B on sm_80/89 (168 registers); 8 warps: 128, no spill
    GemmConfig(64, 64, 64, 4, 4),
]
GEMM_DTYPES = (torch.float16, torch.bfloat16)  # activations the Triton path takes on CUDA


def int8_weight_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantize (weight * scale in fp32), F.linear in fp32, cast back to x's dtype. Any 8-bit weight."""
    w = weight.float() * scale.float().reshape(-1, 1)  # (N,) per channel, or () / (1,) per tensor
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def dequant_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
    """CUDA fallback: dequantize the weight to x's dtype, then F.linear (cuBLAS in x's dtype)."""
    w = (weight.to(torch.float32) * scale.float().reshape(-1, 1)).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


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
    def _weight_only_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K,
                                   stride_xm, stride_wn, stride_om,
                                   HAS_BIAS: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # x (M, K) and w (N, K) have unit stride along K (the launcher makes sure); out (M, N) is packed.
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
        x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + offs_k[:, None]  # a (BLOCK_K, BLOCK_N) tile of W^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b.to(a.dtype), acc)  # int8 / e4m3 -> fp16 / bf16 is exact
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if PER_CHANNEL:
            acc = acc * tl.load(scale_ptr + rn)[None, :]
        else:
            acc = acc * tl.load(scale_ptr)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    return _weight_only_linear_kernel, autotuned(_weight_only_linear_kernel, WEIGHT_ONLY_CONFIGS, interpret)


def weight_only_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                               bias: Optional[torch.Tensor]) -> torch.Tensor:
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape == (N, K), f"weight must be (N, {K}), got {tuple(weight.shape)}"
    assert scale.numel() in (1, N), f"scale must be ({N},) or one per tensor, got {tuple(scale.shape)}"
    assert bias is None or bias.shape == (N,), f"bias must be ({N},), got {tuple(bias.shape)}"
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    scale = scale.to(torch.float32).reshape(-1).contiguous()
    M = rows.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if out.numel():
        _, kernel = _kernels()
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        kernel[grid](rows, weight, scale, scale if bias is None else bias.contiguous(), out, M, N, K,
                     rows.stride(0), weight.stride(0), out.stride(0),
                     HAS_BIAS=bias is not None, PER_CHANNEL=scale.numel() != 1)
    return out.view(*x.shape[:-1], N)


def int8_weight_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    assert weight.dtype == torch.int8, f"int8_weight_linear takes int8 weights, got {weight.dtype}"
    return weight_only_linear_triton(x, weight, scale, bias)


def int8_path(x: torch.Tensor) -> str:
    """"triton", "dequant" (CUDA fallback) or "reference" (CPU): see the module docstring."""
    if x.device.type != "cuda":
        return "reference"
    if x.dtype in GEMM_DTYPES and use_triton(x, "int8_weight_linear"):
        return "triton"
    log_once("int8_weight_linear dequant", f"kiln::int8_weight_linear: {x.dtype} activations (or no Triton) "
             "dequantize the weight per call, then F.linear: a weight-sized temporary and a second GEMM-sized pass")
    return "dequant"


_INT8_PATHS = {"triton": int8_weight_linear_triton, "dequant": dequant_linear, "reference": int8_weight_linear_ref}


def _int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _INT8_PATHS[int8_path(x)](x, weight, scale, bias)


def weight_linear_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    torch._check(weight.dim() == 2 and weight.shape[1] == x.shape[-1],
                 lambda: f"weight must be (N, {x.shape[-1]}), got {tuple(weight.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


int8_weight_linear_op = define_op("int8_weight_linear", _int8_weight_linear, weight_linear_fake)


def int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.ops.kiln.int8_weight_linear(x, weight, scale, bias)


# (weight storage, per-channel scale, oldest GPU arch) of every weight the kernel takes: Kiln's int8_weight
# (per channel), ComfyUI's int8_tensorwise (per tensor) and float8_e4m3fn (per tensor; fp8 needs sm_89+)
WEIGHT_VARIANTS = ((torch.int8, True, 80), (torch.int8, False, 80), (torch.float8_e4m3fn, False, 89))


def gpu_builds() -> list[KernelBuild]:
    """One build per autotune config, activation dtype (fp16, bf16) and weight variant (WEIGHT_VARIANTS)."""
    fn, _ = _kernels()
    builds = []
    for cfg in WEIGHT_ONLY_CONFIGS:
        for dt in GEMM_DTYPES:
            for wdt, per_channel, min_arch in WEIGHT_VARIANTS:
                x, w = triton_dtype(dt), triton_dtype(wdt)
                scale = "per-channel" if per_channel else "per-tensor"
                builds.append(KernelBuild(
                    name=f"weight_only_linear {x} x {w} {scale} {cfg.name}", fn=fn,
                    signature={"x_ptr": f"*{x}", "w_ptr": f"*{w}", "scale_ptr": "*fp32", "bias_ptr": f"*{x}",
                               "out_ptr": f"*{x}", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                               "stride_wn": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr",
                               "PER_CHANNEL": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                               "BLOCK_K": "constexpr", "GROUP_M": "constexpr"},
                    constexprs={"HAS_BIAS": True, "PER_CHANNEL": per_channel, **cfg.constexprs()},
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, min_arch=min_arch, aligned=ALIGNED))
    return builds


# what Triton specialises a real layer's launch on: 16-byte aligned tensors, N, K and row strides divisible by 16
ALIGNED = ("x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")
