"""ComfyUI's fp8 matmul layers as Kiln's compiler must run them (compiler/host_layers.py). Registered when
Kiln's nodes load (nodes/__init__.py).

On a GPU with fp8 matmul, ComfyUI 0.33's mixed-precision Linear (comfy/ops.py `mixed_precision_ops`, a
float8_e4m3fn checkpoint's layers) quantizes its activations inside the layer into a comfy_kitchen
`QuantizedTensor` and runs F.linear on two of them; TorchDynamo cannot capture that subclass made with
symbolic sizes, so a region holding such a layer could only run eagerly. Its stand-in computes the same
from the layer's plain tensors (the weight's `_qdata` and scale, the layer's `input_scale`, its bias)
with kernels/quant/tensorwise_fp8_linear.py, in ops TorchDynamo traces.

The stand-in applies where ComfyUI's own forward would quantize the activations (FP8_LAYOUTS, no weight
or bias function, no forced cast, not the full-precision path, the input a plain tensor without grad,
the weight on the input's device). Elsewhere it calls the layer's own forward: a LoRA patch
(weight_function), low-VRAM offload and training keep ComfyUI's path.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..loaded import compiler

log = logging.getLogger("kiln")

# ComfyUI's layout names whose activations are quantized to float8_e4m3fn per tensor (comfy/quant_ops.py)
FP8_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout")

_HostLayers = compiler.HostLayers if compiler is not None else object


def fp8_linear_forward(layer: torch.nn.Module, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """ComfyUI's fp8 Linear forward in traceable ops (see the module docstring), else the layer's own."""
    weight = layer.weight
    if args or kwargs or not _quantizes_activations(layer, input, weight):
        return type(layer).forward(layer, input, *args, **kwargs)
    pre_quant_scale = getattr(layer, "pre_quant_scale", None)  # ModelOpt AWQ-style smoothing
    if pre_quant_scale is not None:
        input = input * pre_quant_scale.to(input.device, input.dtype)
    input_scale = getattr(layer, "input_scale", None)
    return compiler.tensorwise_fp8_linear(input, weight._qdata, weight._params.scale, input_scale, layer.bias)


def _quantizes_activations(layer: torch.nn.Module, input: torch.Tensor, weight) -> bool:
    """ComfyUI's own forward would quantize `input` (comfy/ops.py MixedPrecisionOps.Linear.forward's
    `_use_quantized and quantize_input`) and the weight is where the input is."""
    return (getattr(layer, "layout_type", None) in FP8_LAYOUTS and type(input) is torch.Tensor
            and not input.requires_grad and input.dim() >= 2 and hasattr(weight, "_qdata")
            and not getattr(layer, "_full_precision_mm", False) and not getattr(layer, "comfy_force_cast_weights", False)
            and not layer.weight_function and not layer.bias_function and weight.device == input.device)


class ComfyLayers(_HostLayers):
    """ComfyUI's layers that need a traceable forward: its fp8 matmul Linear layers."""

    def traceable_forward(self, layer: torch.nn.Module) -> Optional[Callable]:
        if getattr(layer, "layout_type", None) in FP8_LAYOUTS and hasattr(layer, "weight_function"):
            return fp8_linear_forward
        return None


def register() -> None:
    """Have the compiler run ComfyUI's fp8 matmul layers through their traceable stand-in."""
    if compiler is not None:
        compiler.use_host_layers(ComfyLayers())
