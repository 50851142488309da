"""Quantized layers: a Linear or Conv2d whose weight is stored quantized, with its scale beside it.

`QuantLinear` of a scheme that quantizes activations (int8_dynamic, fp8_e4m3) runs
kernels/quant/rowwise_linear.py in plain torch ops where that file has a GEMM for the layer
(`gemm`, decided when the layer is built or moved, never per call): the activation quantization
per row, torch._scaled_mm / torch._int_mm, the scales (its weight scale broadcast to (1, N) once,
`scale_b`) and the bias, all traced, so Inductor fuses the quantization into the op before. Elsewhere,
and for the weight-only schemes, it runs its scheme's kiln:: op (the dequantization fused into a
Triton GEMM); `QuantConv2d` dequantizes its weight and runs the convolution (weight-only:
Kiln has no int8 convolution kernel; under Inductor the dequantization is one fused pointwise
kernel feeding the convolution). Both are plain modules TorchDynamo traces: a compiled model sees
the kiln:: ops and one graph still serves every batch and resolution.

Weight patching (LoRA after quantization) goes through two methods that weight patchers such as
ComfyUI's ModelPatcher look for on the layer owning a weight: `convert_weight` gives the patcher
the dequantized float weight to patch, and `set_weight` stores the patched weight quantized again
on the layer's own scales. The scales never change, so a patcher that restores the weight tensor
it backed up (as ComfyUI does when it unpatches) restores the exact original layer. The cost: a
patch that takes a weight beyond the range its scale was set for is clipped there (said in the
log, with the layer and how far); LoRA deltas are usually far inside that range, and a LoRA
applied before quantizing is baked in exactly.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from ... import kernels  # noqa: F401  registers the kiln:: GEMM ops the layers call
from ...kernels.quant.rowwise_linear import gemm_for, rowwise_linear
from .scheme import SCHEMES, Scheme, _broadcast

log = logging.getLogger("kiln")


class _QuantLayer(torch.nn.Module):
    scheme_name: str

    def _init_quant(self, scheme: Scheme, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
        assert weight.dtype == scheme.storage, f"{scheme.name} stores {scheme.storage}, got {weight.dtype}"
        self.scheme_name = scheme.name
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale.to(torch.float32))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.scheme_name]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.scheme.dequantize(self.weight, self.weight_scale, dtype)

    # ---- the weight-patching protocol (ComfyUI's ModelPatcher calls these by name) ----------

    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **kwargs) -> torch.Tensor:
        """The float weight a patcher patches: `weight` is this layer's stored weight (or a float
        copy of its stored values), dequantized on this layer's scales."""
        return self.scheme.dequantize(weight, self.weight_scale, torch.float32)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed: Optional[int] = None,
                   return_weight: bool = False, **kwargs):
        """Store a patched float weight, quantized on this layer's own scales (stochastic rounding
        when the patcher gives a seed, so a patch smaller than one quantization step still counts)."""
        self._warn_if_clipped(weight)
        stored, _ = self.scheme.quantize(weight, self.weight_scale, seed=seed)
        if return_weight:
            return stored
        self.weight = torch.nn.Parameter(stored.to(self.weight.device), requires_grad=False)

    def _on_device_of(self, x: torch.Tensor, names: tuple = ("weight", "weight_scale", "bias")) -> tuple:
        """The tensors `names` (default: weight, scale, bias) on x's device. A host that leaves some layers
        on another device (ComfyUI's low-VRAM partial loading) gets them copied for each call, said once."""
        tensors = tuple(getattr(self, name) for name in names)
        if self.weight.device == x.device:
            return tensors
        _say_once(f"Kiln: quantized layers are on {self.weight.device} and their input on {x.device}: their weights are "
                  "copied over on each call (a partially loaded model); give the model enough memory to load whole")
        return tuple(None if t is None else t.to(x.device, non_blocking=True) for t in tensors)

    def _warn_if_clipped(self, weight: torch.Tensor) -> None:
        """A patch that takes a weight beyond the range its scale was set for is clipped there: say so."""
        ratio = (weight.detach().float().abs() / _broadcast(self.weight_scale.to(weight.device), weight.dim()))
        over = ratio > self.scheme.qmax * 1.01
        if over.any():
            log.warning("Kiln: a weight patch (LoRA) on a quantized %s layer %s goes %.2fx beyond the range quantized for "
                        "it; %d values were clipped. Put this LoRA before Kiln › Quantize Model to bake it in exactly.",
                        self.scheme_name, tuple(weight.shape), ratio.max().item() / self.scheme.qmax, int(over.sum()))

    def _apply(self, fn, recurse=True):
        """Moves between devices; a dtype cast (model.half(), .to(bf16)) must not touch the stored
        weight or its scale (float8 counts as floating point to torch)."""
        stored = self.weight.dtype
        super()._apply(fn, recurse)
        if self.weight.dtype != stored:
            self.weight = torch.nn.Parameter(self.weight.data.to(stored), requires_grad=False)
        for name in ("weight_scale", "scale_b"):
            scale = getattr(self, name, None)
            if scale is not None and scale.dtype != torch.float32:
                setattr(self, name, scale.to(torch.float32))
        self._placed()
        return self

    def _placed(self) -> None:
        """Called when the layer is built and after each move: what depends on its device."""


class QuantLinear(_QuantLayer):
    """y = x @ W^T + b with W stored quantized. x: (..., in_features) -> (..., out_features), x's dtype."""

    def __init__(self, scheme: Scheme, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        assert weight.dim() == 2, f"a Linear weight is (out, in), got {tuple(weight.shape)}"
        self.out_features, self.in_features = weight.shape
        self._init_quant(scheme, weight, scale, bias)
        self.gemm: Optional[str] = None  # rowwise_linear's GEMM for this layer where it has one, else None
        if scheme.quantizes_activations:  # the weight's scale as the GEMM's epilogue takes it: (1, N), fp32
            self.register_buffer("scale_b", self._scale_row(), persistent=False)
        self._placed()

    def _scale_row(self) -> torch.Tensor:
        return self.weight_scale.float().reshape(-1).expand(self.out_features).reshape(1, self.out_features).contiguous()

    def _load_from_state_dict(self, *args, **kwargs):
        """A state dict loaded into the layer may bring another weight_scale: scale_b follows it."""
        super()._load_from_state_dict(*args, **kwargs)
        if self.scheme.quantizes_activations:
            self.scale_b = self._scale_row()

    def _placed(self) -> None:
        if self.scheme.quantizes_activations:
            self.gemm = gemm_for(self.weight.dtype, self.weight.device, self.in_features, self.out_features)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear, scheme: Scheme, out_device=None) -> "QuantLinear":
        stored, scale = scheme.quantize(linear.weight)
        bias = linear.bias
        return cls(scheme, stored.to(out_device), scale.to(out_device),
                   None if bias is None else bias.detach().to(out_device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            weight, scale_b, bias = self._on_device_of(x, ("weight", "scale_b", "bias"))
            return rowwise_linear(x, weight.t(), scale_b, bias, self.gemm)
        weight, scale, bias = self._on_device_of(x)
        return self.scheme.linear()(x, weight, scale, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme_name}"


class QuantConv2d(_QuantLayer):
    """A Conv2d with its weight stored quantized (weight-only: dequantized, then F.conv2d)."""

    def __init__(self, scheme: Scheme, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                 stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
        super().__init__()
        assert weight.dim() == 4, f"a Conv2d weight is (out, in/groups, kh, kw), got {tuple(weight.shape)}"
        if padding_mode != "zeros":
            raise ValueError(f"QuantConv2d supports padding_mode='zeros', not {padding_mode!r}")
        self.out_channels = weight.shape[0]
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        # the float weight's strides where they are not the standard ones (a channels-last model): a
        # convolution's output takes its weight's memory format, and the dequantized weight must give
        # the same as eager (a 1x1 kernel's layout is lost in quantizing, its strides being ambiguous),
        # or the next block sees another layout than in eager and recompiles for it
        self.weight_strides: Optional[tuple] = None
        self._init_quant(scheme, weight, scale, bias)

    @classmethod
    def from_float(cls, conv: torch.nn.Conv2d, scheme: Scheme, out_device=None) -> "QuantConv2d":
        stored, scale = scheme.quantize(conv.weight)
        bias = conv.bias
        layer = cls(scheme, stored.to(out_device), scale.to(out_device),
                    None if bias is None else bias.detach().to(out_device),
                    conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)
        if conv.weight.stride() != torch.empty(conv.weight.shape, device="meta").stride():
            layer.weight_strides = tuple(conv.weight.stride())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, scale, bias = self._on_device_of(x)
        weight = self.scheme.dequantize(weight, scale, x.dtype)
        if self.weight_strides is not None:
            weight = torch.empty_strided(weight.shape, self.weight_strides, dtype=weight.dtype,
                                         device=weight.device).copy_(weight)
        bias = None if bias is None else bias.to(x.dtype)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1] * self.groups}, {self.out_channels}, kernel_size={tuple(self.weight.shape[2:])}, " \
               f"stride={self.stride}, padding={self.padding}, scheme={self.scheme_name}"


QUANT_LAYERS = (QuantLinear, QuantConv2d)
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


def quantized_layers(module: torch.nn.Module) -> dict[str, _QuantLayer]:
    return {name: m for name, m in module.named_modules() if isinstance(m, QUANT_LAYERS)}
