"""W8A8 Linear in plain, traceable torch ops: activations quantized per row (per token), one 8-bit GEMM,
both scales and the bias in its epilogue. No custom op: TorchDynamo traces it whole, so Inductor fuses
the activation quantization (a row amax, a divide, a clamp, a cast) into the op that made x (a norm, a
GELU) and the scaling epilogue into the op after.

    quantize_rows(x (M, K) float, storage) -> (xq (M, K) storage, scale_a (M, 1) float32)
        scale_a = max(amax(|row|) / QMAX, EPS); xq = x / scale_a, rounded (int8) and clamped to +-QMAX
    rowwise_linear(x (..., K) float, weight_t (K, N) storage, scale_b (1, N) float32, bias (N,) | None, gemm)
        -> (..., N) in x.dtype = (xq @ weight_t) * scale_a * scale_b + bias

`weight_t` is the layer's stored (N, K) weight seen transposed (`weight.t()`, a view: the column-major
operand torch._scaled_mm wants); `scale_b` the weight's scale broadcast to (1, N) once, when the layer
is built, never per call. Nothing here reads a value back to the host (no `.item()`).

`gemm` (decided by the layer when it is built or moved, `gemm_for`):
    "scaled_mm"   CUDA sm_89+, float8 e4m3, K and N multiples of SCALED_MM_ALIGN: torch._scaled_mm with
                  rowwise scales and use_fast_accum. Its rowwise kernels write bf16 (ROWWISE_OUT_DTYPE, the
                  only output torch's rowwise cuBLASLt/CUTLASS kernels have taken): an fp16 model gets a
                  bf16 GEMM output cast back, with the bias added in that same pointwise (fused by Inductor).
    "int_mm"      int8 on the CPU, or on CUDA with K and N multiples of INT_MM_ALIGN: torch._int_mm (exact
                  int32 accumulation), the scales and the bias after it. CUDA's kernel wants more than
                  INT_MM_MIN_ROWS rows; fewer go through "reference" (a guard on M, decided once per graph).
    "reference"   the same math in fp32 on any device: the 8-bit operands converted to fp32 (exact), a
                  float32 matmul, the same epilogue. The CPU's fp8 path, and what the tests compare against.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._gemm import EPS, FP8_MAX, INT8_MAX

SCALED_MM_ALIGN = 16       # torch._scaled_mm wants K and N multiples of 16
INT_MM_ALIGN = 8           # torch._int_mm on CUDA wants K and N multiples of 8
INT_MM_MIN_ROWS = 16       # ... and more than 16 rows
FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) on
ROWWISE_OUT_DTYPE = torch.bfloat16
GEMMS = ("scaled_mm", "int_mm", "reference")


def quantize_rows(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (xq (M, K) `storage`, scale_a (M, 1) float32): symmetric, one scale per row."""
    assert x.dim() == 2, f"quantize_rows takes (M, K), got {tuple(x.shape)}"
    qmax = INT8_MAX if storage == torch.int8 else FP8_MAX
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(EPS)
    scaled = xf / scale
    if storage == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp(-qmax, qmax).to(storage), scale


def gemm_for(storage: torch.dtype, device: torch.device, K: int, N: int) -> Optional[str]:
    """The traceable GEMM for a layer of this storage on `device`, or None where this file has none
    (the layer then runs its kiln:: custom op: fp8 before sm_89 or with K, N not multiples of 16, and
    int8 on CUDA with K, N not multiples of 8)."""
    if device.type != "cuda":
        return "int_mm" if storage == torch.int8 else "reference"
    if storage == torch.int8:
        return "int_mm" if K % INT_MM_ALIGN == 0 and N % INT_MM_ALIGN == 0 else None
    capable = torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY and hasattr(torch, "_scaled_mm")
    return "scaled_mm" if capable and K % SCALED_MM_ALIGN == 0 and N % SCALED_MM_ALIGN == 0 else None


def rowwise_linear(x: torch.Tensor, weight_t: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor],
                   gemm: str) -> torch.Tensor:
    """(..., K) -> (..., N) in x.dtype; see the module docstring."""
    K, N = weight_t.shape
    assert scale_b.shape == (1, N), f"scale_b must be (1, {N}), got {tuple(scale_b.shape)}"
    rows = x.reshape(-1, K)
    xq, scale_a = quantize_rows(rows, weight_t.dtype)
    if gemm == "scaled_mm":
        out = _scaled_mm_rowwise(xq, weight_t, scale_a, scale_b, bias, x.dtype)
    elif gemm == "int_mm" and (xq.device.type == "cpu" or xq.shape[0] > INT_MM_MIN_ROWS):
        out = _epilogue(torch._int_mm(xq, weight_t), scale_a, scale_b, bias, x.dtype)
    else:
        out = _epilogue(xq.float() @ weight_t.float(), scale_a, scale_b, bias, x.dtype)
    return out.view(*x.shape[:-1], N)


def _epilogue(acc: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor],
              dtype: torch.dtype) -> torch.Tensor:
    """acc (M, N) int32 or float32 -> acc * scale_a * scale_b + bias, in fp32, cast to `dtype`."""
    out = acc.float() * scale_a * scale_b
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def _scaled_mm_rowwise(xq: torch.Tensor, weight_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    fused_bias = bias is not None and dtype == ROWWISE_OUT_DTYPE and bias.dtype == dtype
    out = torch._scaled_mm(xq, weight_t, scale_a=scale_a, scale_b=scale_b, bias=bias if fused_bias else None,
                           out_dtype=ROWWISE_OUT_DTYPE, use_fast_accum=True)
    if bias is not None and not fused_bias:
        return (out.float() + bias.float()).to(dtype)
    return out.to(dtype)


def rowwise_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same math in float64 from a layer's stored (N, K) weight and its (N,) or () scale: what the
    tests hold every path to."""
    K = x.shape[-1]
    N = weight.shape[0]
    rows = x.reshape(-1, K)
    xq, scale_a = quantize_rows(rows, weight.dtype)
    scale_b = weight_scale.double().reshape(-1).expand(N).reshape(1, N)
    out = (xq.double() @ weight.double().t()) * scale_a.double() * scale_b
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).view(*x.shape[:-1], N)
