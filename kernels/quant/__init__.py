"""Quantized GEMM kernels, each a kiln:: custom op with a pure-torch reference:

    quantize_per_token   x (M, K) float -> (int8 (M, K), scale (M,) float32)   per-token activations
    int8_weight_linear   x @ (int8 W * per-channel or per-tensor scale).T + bias   weight-only int8
    fp8_weight_linear    x @ (e4m3 W * per-tensor scale).T + bias               ComfyUI's fp8 weights
    int8_mm_scaled       int8 x int8 -> int32 GEMM, both scales and the bias in its epilogue
    int8_dynamic_linear  quantize_per_token, then int8_mm_scaled                 W8A8
    rowwise_linear       W8A8 in plain traceable torch ops (no custom op): rows quantized, then
                         torch._scaled_mm (fp8) / torch._int_mm (int8), scales and bias after
    tensorwise_fp8_linear  fp8 x fp8 with one static activation scale: ComfyUI's fp8 layers' math, traceable

compiler/quantize's QuantLinear layers call these by name (torch.ops.kiln.<op>).
"""
from ._gemm import EPS, FP8_MAX, INT8_MAX
from .int8_dynamic_linear import (int8_dynamic_linear, int8_dynamic_linear_ref, int8_dynamic_linear_triton,
                                  int8_mm_scaled, int8_mm_scaled_ref, int8_mm_scaled_triton)
from .fp8_weight_linear import fp8_weight_linear, fp8_weight_linear_ref, fp8_weight_linear_triton
from .int8_weight_linear import int8_weight_linear, int8_weight_linear_ref, int8_weight_linear_triton
from .quantize_per_token import quantize_per_token, quantize_per_token_ref, quantize_per_token_triton
from .rowwise_linear import gemm_for, quantize_rows, rowwise_linear, rowwise_linear_ref
from .tensorwise_fp8_linear import tensorwise_fp8_linear

__all__ = ["EPS", "FP8_MAX", "INT8_MAX",
           "quantize_per_token", "quantize_per_token_ref", "quantize_per_token_triton",
           "int8_weight_linear", "int8_weight_linear_ref", "int8_weight_linear_triton",
           "fp8_weight_linear", "fp8_weight_linear_ref", "fp8_weight_linear_triton",
           "int8_mm_scaled", "int8_mm_scaled_ref", "int8_mm_scaled_triton",
           "int8_dynamic_linear", "int8_dynamic_linear_ref", "int8_dynamic_linear_triton",
           "quantize_rows", "gemm_for", "rowwise_linear", "rowwise_linear_ref", "tensorwise_fp8_linear"]
