"""Kiln's Triton kernels, each a `torch.library` custom op (kiln::<name>) with a fake impl and a
pure-torch reference. Importing this registers the ops; it never imports Triton."""
from ._library import triton_available
from .geglu import geglu, geglu_ref, geglu_triton
from .group_norm_silu import group_norm_silu, group_norm_silu_ref, group_norm_silu_triton
from .layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_ref, layer_norm_modulate_triton
from .quant import (fp8_weight_linear, fp8_weight_linear_ref, fp8_weight_linear_triton, int8_dynamic_linear,
                    int8_dynamic_linear_ref, int8_dynamic_linear_triton, int8_mm_scaled, int8_mm_scaled_ref,
                    int8_mm_scaled_triton, int8_weight_linear, int8_weight_linear_ref, int8_weight_linear_triton,
                    quantize_per_token, quantize_per_token_ref, quantize_per_token_triton)

__all__ = ["triton_available", "geglu", "geglu_ref", "geglu_triton",
           "group_norm_silu", "group_norm_silu_ref", "group_norm_silu_triton",
           "layer_norm_modulate", "layer_norm_modulate_ref", "layer_norm_modulate_triton",
           "quantize_per_token", "quantize_per_token_ref", "quantize_per_token_triton",
           "int8_weight_linear", "int8_weight_linear_ref", "int8_weight_linear_triton",
           "fp8_weight_linear", "fp8_weight_linear_ref", "fp8_weight_linear_triton",
           "int8_mm_scaled", "int8_mm_scaled_ref", "int8_mm_scaled_triton",
           "int8_dynamic_linear", "int8_dynamic_linear_ref", "int8_dynamic_linear_triton"]
