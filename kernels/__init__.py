"""Kiln's Triton kernels, each a `torch.library` custom op (kiln::<name>) with a fake impl and a
pure-torch reference. Importing this registers the ops; it never imports Triton."""
from ._library import triton_available
from .geglu import geglu, geglu_ref, geglu_triton
from .group_norm_silu import group_norm_silu, group_norm_silu_ref, group_norm_silu_triton
from .layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_ref, layer_norm_modulate_triton

__all__ = ["triton_available", "geglu", "geglu_ref", "geglu_triton",
           "group_norm_silu", "group_norm_silu_ref", "group_norm_silu_triton",
           "layer_norm_modulate", "layer_norm_modulate_ref", "layer_norm_modulate_triton"]
