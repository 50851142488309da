"""Quantization schemes: the pure math of turning a float weight into stored values and scales.

One `Scheme` per name in SCHEMES. Each says how a weight is stored (int8 or float8_e4m3fn), how
its scale is shaped (one per output channel, or one per tensor), which Kiln op runs its Linear
layers, and which key marks its layers in a saved file. Nothing here touches a module.

    int8_weight   int8 weights, per-output-channel scale = amax/127; activations stay in high
                  precision and the GEMM dequantizes the weight tile (kiln::int8_weight_linear).
    int8_dynamic  the same weights; activations quantized per token at run time (amax/127) and
                  an int8 x int8 -> int32 GEMM with both scales and the bias in its epilogue
                  (kernels/quant/rowwise_linear.py, traceable; kiln::int8_dynamic_linear where it has no GEMM).
    fp8_e4m3      float8_e4m3fn weights, one per-tensor scale = amax/448: ComfyUI 0.8's own
                  format (comfy/quant_ops.py), so stock ComfyUI loads Kiln's files; activations
                  quantized per row to e4m3 at run time (rowwise_linear.py: torch._scaled_mm on
                  sm_89+; kiln::fp8_weight_linear, weight-only, where it has no GEMM).
    int8_tensorwise  int8 weights, one per-tensor scale = amax/127, weight-only like int8_weight
                  (kiln::int8_weight_linear): ComfyUI's own int8 format (0.33 has it, 0.8 does not),
                  so a ComfyUI that lists it loads Kiln's files.

ComfyUI's formats (file_key "comfy_quant") hold Linear layers only: under fp8_e4m3 and
int8_tensorwise Kiln keeps convolutions in high precision (policy.py), so every layer of the file
is one stock ComfyUI reads. `readers` says, per scheme, what loads a saved file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ... import choices
# the kernels' own constants: the largest stored magnitudes, and the scale of an all-zero channel
from ...kernels.quant import EPS as _TINY
from ...kernels.quant import FP8_MAX, INT8_MAX


@dataclass(frozen=True)
class Scheme:
    """name: the scheme's name; storage: the stored weight dtype; per_channel: one scale per output
    channel (else one per tensor); linear_op: the kiln:: op its Linear layers run; file_format: the
    format name its layers carry in a saved file; file_key: the key that carries it ("comfy_quant"
    for ComfyUI's own format, "kiln_quant" for Kiln's); readers: what loads a file of this scheme."""

    name: str
    storage: torch.dtype
    per_channel: bool
    linear_op: str
    file_format: str
    file_key: str
    readers: str
    quantizes_activations: bool = False  # W8A8: activations quantized per row at run time (rowwise_linear.py)

    @property
    def comfyui_format(self) -> bool:
        """Saved in one of ComfyUI's own formats, which hold Linear layers only."""
        return self.file_key == "comfy_quant"

    @property
    def qmax(self) -> float:
        return INT8_MAX if self.storage == torch.int8 else FP8_MAX

    def scale_for(self, weight: torch.Tensor) -> torch.Tensor:
        """float32 scale(s) for `weight` (out, ...): (out,) per channel, () per tensor."""
        w = weight.detach().float()
        amax = w.reshape(w.shape[0], -1).abs().amax(dim=1) if self.per_channel else w.abs().amax()
        return (amax / self.qmax).clamp_min(_TINY)

    def quantize(self, weight: torch.Tensor, scale: Optional[torch.Tensor] = None,
                 seed: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored weight, scale). With `scale` given, quantize on it (values beyond its range clip);
        with `seed`, round stochastically (a patch smaller than one step survives on average)."""
        scale = self.scale_for(weight) if scale is None else scale.to(weight.device, torch.float32)
        scaled = weight.detach().float() / _broadcast(scale, weight.dim())
        if seed is not None:
            scaled = scaled + _rounding_noise(scaled, self.storage, seed)
        if self.storage == torch.int8:
            stored = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            stored = scaled.clamp(-FP8_MAX, FP8_MAX).to(self.storage)
        return stored, scale

    @staticmethod
    def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (stored.to(torch.float32) * _broadcast(scale.to(stored.device, torch.float32), stored.dim())).to(dtype)

    def linear(self) -> Callable:
        return getattr(torch.ops.kiln, self.linear_op)


def _broadcast(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel scale (out,) as (out, 1, ...) against an ndim weight; a 0-dim scale as is."""
    return scale.reshape(-1, *([1] * (ndim - 1))) if scale.dim() == 1 else scale


def _rounding_noise(scaled: torch.Tensor, storage: torch.dtype, seed: int) -> torch.Tensor:
    """Uniform noise of one rounding step, centred: nearest rounding of value + noise is stochastic
    rounding. int8's step is 1; float8 e4m3's is 2^(exponent - 3), down to 2^-9 for subnormals."""
    generator = torch.Generator(device=scaled.device).manual_seed(seed)
    noise = torch.rand(scaled.shape, generator=generator, device=scaled.device) - 0.5
    if storage == torch.int8:
        return noise
    exponent = torch.floor(torch.log2(scaled.abs().clamp_min(2.0 ** -6)))
    return noise * torch.exp2(exponent - 3)


KILN_ONLY = "Kiln only (Kiln's own per-channel format)"
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("int8_weight", torch.int8, True, "int8_weight_linear", "kiln_int8_weight", "kiln_quant", KILN_ONLY),
    Scheme("int8_dynamic", torch.int8, True, "int8_dynamic_linear", "kiln_int8_dynamic", "kiln_quant", KILN_ONLY,
           quantizes_activations=True),
    Scheme("fp8_e4m3", torch.float8_e4m3fn, False, "fp8_weight_linear", "float8_e4m3fn", "comfy_quant",
           "ComfyUI 0.8.0 and newer (stock loader) and Kiln", quantizes_activations=True),
    Scheme("int8_tensorwise", torch.int8, False, "int8_weight_linear", "int8_tensorwise", "comfy_quant",
           "ComfyUI with int8_tensorwise (0.33.0 has it; 0.8.0 does not) and Kiln"),
)}
assert tuple(SCHEMES) == tuple(choices.SCHEMES), "one Scheme per scheme of choices.py, in its order"


class QuantizeError(ValueError):
    """A quantization setting or file is invalid; the message names it and what is allowed."""


def scheme_named(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise QuantizeError(f"unknown quantization scheme {name!r}; Kiln has {', '.join(SCHEMES)}") from None
