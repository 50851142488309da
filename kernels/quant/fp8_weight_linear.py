"""Weight-only fp8 Linear (kiln::fp8_weight_linear): ComfyUI's fp8 weights, float8 e4m3 with one scale
per tensor, activations in high precision.

Why it is still a custom op: Kiln's fp8_e4m3 layers run rowwise_linear.py (traceable rowwise activation
quantization and torch._scaled_mm, which Inductor fuses with the ops around it) wherever torch._scaled_mm
takes the layer: CUDA sm_89+ with K and N multiples of 16, and the CPU's reference. This op serves the
rest, which no traced fp8 GEMM takes: CUDA before sm_89 and odd K or N, where the Triton weight-only
kernel (or a dequantized F.linear) must run as one opaque call. Its "scaled_mm" path below (per-tensor
activation scale, a global amax per call) remains for callers of the op itself.

    fp8_weight_linear(x (..., K) float, weight (N, K) float8_e4m3fn, scale () or (1,) float32, bias)
        -> (..., N) in x.dtype = (x @ weight.T) * scale + bias

Which path runs where (`fp8_path` decides; a fallback says so once in the log):
    CPU (any dtype)                    reference: dequantize to fp32, F.linear in fp32, cast back.
    CUDA sm_89+, K % 16 == N % 16 == 0
                                       torch._scaled_mm: x quantized per tensor to e4m3 at run time
                                       (scale_x = amax(|x|) / 448) and an fp8 x fp8 tensor-core GEMM
                                       with both scales and the bias (fp16/bf16 x) applied by cuBLASLt.
    CUDA sm_89+, other K or N          int8_weight_linear.py's Triton kernel with fp8 storage (fp16/bf16
                                       x; Triton's fp8e4nv needs sm_89), else dequantize + F.linear.
    CUDA before sm_89                  dequantize to x's dtype + F.linear.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._library import define_op, log_once, triton_available
from ._gemm import EPS, FP8_MAX
from .int8_weight_linear import (GEMM_DTYPES, dequant_linear, int8_weight_linear_ref, weight_linear_fake,
                                 weight_only_linear_triton)

SCALED_MM_ALIGN = 16  # torch._scaled_mm wants K and N multiples of 16


def fp8_weight_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantize (weight * scale in fp32), F.linear in fp32, cast back: the int8 op's reference, any 8-bit weight."""
    return int8_weight_linear_ref(x, weight, scale, bias)


def fp8_weight_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight-only kernel with float8_e4m3fn weights and one scale (sm_89+ on CUDA; any CPU under the interpreter)."""
    assert weight.dtype == torch.float8_e4m3fn, f"fp8_weight_linear takes float8_e4m3fn weights, got {weight.dtype}"
    assert scale.numel() == 1, f"fp8_weight_linear takes one per-tensor scale, got {tuple(scale.shape)}"
    return weight_only_linear_triton(x, weight, scale, bias)


def fp8_weight_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """CUDA sm_89+, K and N multiples of 16: x quantized per tensor to e4m3 now, fp8 x fp8 GEMM by cuBLASLt."""
    K = x.shape[-1]
    N = weight.shape[0]
    rows = x.reshape(-1, K)
    scale_x = (rows.abs().amax().float() / FP8_MAX).clamp_min(EPS)
    x_fp8 = (rows.float() / scale_x).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    fused_bias = bias is not None and x.dtype in GEMM_DTYPES
    out = torch._scaled_mm(x_fp8, weight.contiguous().t(), scale_a=scale_x, scale_b=scale.float().reshape(()),
                           bias=bias.to(x.dtype) if fused_bias else None, out_dtype=x.dtype)
    if bias is not None and not fused_bias:
        out = out + bias.to(x.dtype)
    return out.view(*x.shape[:-1], N)


def fp8_path(device_type: str, capability: tuple[int, int], dtype: torch.dtype, K: int, N: int,
             triton_ok: bool) -> str:
    """"scaled_mm", "triton", "dequant" or "reference" for these inputs: see the module docstring."""
    if device_type != "cuda":
        return "reference"
    if capability >= (8, 9):
        if K % SCALED_MM_ALIGN == 0 and N % SCALED_MM_ALIGN == 0 and hasattr(torch, "_scaled_mm"):
            return "scaled_mm"
        if dtype in GEMM_DTYPES and triton_ok:
            return "triton"
    return "dequant"


_FP8_PATHS = {"scaled_mm": fp8_weight_linear_scaled_mm, "triton": fp8_weight_linear_triton,
              "dequant": dequant_linear, "reference": fp8_weight_linear_ref}


def _fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    cuda = x.device.type == "cuda"
    path = fp8_path(x.device.type, torch.cuda.get_device_capability(x.device) if cuda else (0, 0), x.dtype,
                    x.shape[-1], weight.shape[0], cuda and triton_available())
    if path == "dequant":
        log_once("fp8_weight_linear dequant", "kiln::fp8_weight_linear: no fp8 GEMM for these inputs (before sm_89, "
                 "fp32 activations or no Triton): the weight is dequantized per call, then F.linear")
    return _FP8_PATHS[path](x, weight, scale, bias)


fp8_weight_linear_op = define_op("fp8_weight_linear", _fp8_weight_linear, weight_linear_fake)


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.ops.kiln.fp8_weight_linear(x, weight, scale, bias)
