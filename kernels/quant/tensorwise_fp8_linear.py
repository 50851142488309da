"""fp8 Linear with one static scale per tensor for the activations, in plain traceable torch ops: the math of
ComfyUI's fp8 matmul layers (its float8_e4m3fn layout: the activations scaled by the layer's `input_scale`,
or 1 without one, clamped to +-448 and cast; an fp8 x fp8 GEMM with both scales), written so that
TorchDynamo captures it. nodes/comfy_layers.py hands it the plain tensors of ComfyUI's layers.

    tensorwise_fp8_linear(x (..., K) float, weight (N, K) float8_e4m3fn, weight_scale () fp32,
                          input_scale () fp32 | None, bias (N,) | None) -> (..., N) in x.dtype
        = (fp8(clamp(x / input_scale)) @ weight.T) * input_scale * weight_scale + bias

Where it runs:
    CUDA sm_89+, K and N multiples of 16: torch._scaled_mm with per-tensor scales (any 16-bit output),
        the bias in its epilogue; use_fast_accum off, as ComfyUI runs it, so the image is ComfyUI's.
    elsewhere: the same math in fp32 (the 8-bit operands converted exactly, a float32 matmul).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._gemm import FP8_MAX
from .rowwise_linear import FP8_MIN_CAPABILITY, SCALED_MM_ALIGN

SCALED_MM_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tensorwise_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          input_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                          use_scaled_mm: Optional[bool] = None) -> torch.Tensor:
    """See the module docstring. `use_scaled_mm`: None decides from x's device and the shapes."""
    N, K = weight.shape
    rows = x.reshape(-1, K)
    x_scale = torch.ones((), device=x.device, dtype=torch.float32) if input_scale is None else input_scale.float()
    xq = (rows * (1.0 / x_scale).to(rows.dtype)).clamp(-FP8_MAX, FP8_MAX).to(weight.dtype)
    w_scale = weight_scale.float()
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_fits(x.device, x.dtype, K, N)
    if use_scaled_mm:
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()),
                               bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    else:
        out = (xq.float() @ weight.float().t()) * (x_scale * w_scale)
        if bias is not None:
            out = out + bias.float()
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], N)


def scaled_mm_fits(device: torch.device, dtype: torch.dtype, K: int, N: int) -> bool:
    """torch._scaled_mm takes this call: CUDA sm_89+, K and N multiples of 16, a float output."""
    return (device.type == "cuda" and dtype in SCALED_MM_OUT_DTYPES and K % SCALED_MM_ALIGN == 0
            and N % SCALED_MM_ALIGN == 0 and fp8_tensor_cores(device.index or 0))


def fp8_tensor_cores(device_index: int) -> bool:
    """The CUDA device has fp8 tensor cores (sm_89+). Read while TorchDynamo captures a layer: a constant of
    the graph (a device does not change its capability), not a call it would have to trace."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device_index) >= FP8_MIN_CAPABILITY


# what torch.compiler.assume_constant_result(fn) does (checked: torch 2.13), set here without calling it:
# that call imports TorchDynamo, and so Triton, when Kiln is imported
fp8_tensor_cores._dynamo_marked_constant = True
