"""Quantized models in safetensors files (no pickle), in ComfyUI 0.8's layout.

Each quantized layer `<layer>` has, beside its usual keys (`<layer>.bias` in high precision):
- `<layer>.weight`: the stored weight, int8 (I8) or float8_e4m3fn (F8_E4M3), the layer's shape;
- `<layer>.weight_scale`: float32, per tensor (a 0-dim tensor, fp8) or per output channel (int8);
- a format marker: a uint8 tensor holding JSON. fp8_e4m3 layers use ComfyUI's own key and value,
  `<layer>.comfy_quant` = {"format": "float8_e4m3fn"}, so stock ComfyUI's UNet loader loads Kiln's
  fp8 files; int8 layers (ComfyUI 0.8 has no int8 format) use Kiln's own key in the same style,
  `<layer>.kiln_quant` = {"format": "kiln_int8_weight" | "kiln_int8_dynamic"}; only Kiln loads those.
- ComfyUI's optional `<layer>.input_scale` (a static activation scale) is read and not used: Kiln
  scales activations per call, from their own range.
The file's metadata has "kiln_quant": the QuantReport (JSON) of the model it was saved from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from .layers import QuantConv2d, QuantLinear, quantized_layers
from .report import QuantReport
from .scheme import SCHEMES, QuantizeError, Scheme

FORMAT_KEYS = ("comfy_quant", "kiln_quant")
_BY_FORMAT = {s.file_format: s for s in SCHEMES.values()}
METADATA_KEY = "kiln_quant"


@dataclass
class StoredLayer:
    """One quantized layer read from a file: its scheme, stored weight and scale."""

    scheme: Scheme
    weight: torch.Tensor
    scale: torch.Tensor
    ignored: tuple[str, ...] = ()


def quantized_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict with each quantized layer's format marker added: what `save` writes."""
    sd = {k: v.contiguous() for k, v in module.state_dict().items()}
    for name, layer in quantized_layers(module).items():
        sd[f"{name}.{layer.scheme.file_key}"] = _json_tensor({"format": layer.scheme.file_format})
    return sd


def save(module: torch.nn.Module, path: str, metadata: Optional[dict[str, str]] = None) -> None:
    """Write a quantized module (from `quantize`) to a safetensors file."""
    from safetensors.torch import save_file

    if not quantized_layers(module):
        raise QuantizeError(f"{type(module).__name__} has no Kiln-quantized layers: nothing to save as a quantized model")
    meta = dict(metadata or {})
    report = getattr(module, "kiln_quant_report", None)
    if isinstance(report, QuantReport):
        meta[METADATA_KEY] = json.dumps(report.as_dict())
    save_file(quantized_state_dict(module), path, metadata=meta)


def pop_quantized_layer(state_dict: dict, prefix: str) -> Optional[StoredLayer]:
    """Take the quantized layer at `prefix` ("input_blocks.1.1.proj_in.") out of `state_dict`: its
    weight, scale and markers are removed, its bias is left. None if that layer is not quantized."""
    for key in FORMAT_KEYS:
        marker = state_dict.pop(f"{prefix}{key}", None)
        if marker is not None:
            break
    else:
        return None
    layer = prefix.rstrip(".")
    conf = json.loads(bytes(marker.to(torch.uint8).tolist()).decode("utf-8"))
    scheme = _BY_FORMAT.get(conf.get("format"))
    if scheme is None:
        raise QuantizeError(f"layer {layer} is quantized as {conf.get('format')!r}, which Kiln cannot load "
                            f"(Kiln loads {', '.join(_BY_FORMAT)}); load this file with ComfyUI's own loader")
    weight = state_dict.pop(f"{prefix}weight", None)
    if weight is None:
        raise QuantizeError(f"layer {layer} is marked quantized but the file has no {prefix}weight")
    scale = state_dict.pop(f"{prefix}weight_scale", None)
    if scale is None:
        if scheme.per_channel:
            raise QuantizeError(f"layer {layer} ({scheme.name}) has no {prefix}weight_scale")
        scale = torch.ones((), dtype=torch.float32)  # ComfyUI reads a missing fp8 scale as 1
    ignored = tuple(k for k in ("input_scale",) if state_dict.pop(f"{prefix}{k}", None) is not None)
    return StoredLayer(scheme, weight.to(scheme.storage), scale.to(torch.float32), ignored)


def split_quantized(state_dict: dict) -> dict[str, StoredLayer]:
    """Take every quantized layer out of `state_dict` (see pop_quantized_layer): {layer name: StoredLayer}."""
    layers = [key.rpartition(".")[0] for key in list(state_dict) if key.rpartition(".")[2] in FORMAT_KEYS]
    return {layer: pop_quantized_layer(state_dict, layer + ".") for layer in layers}


def install(module: torch.nn.Module, stored: dict[str, StoredLayer]) -> torch.nn.Module:
    """Replace each named float layer of `module` by the quantized layer read from a file (its bias
    is the float layer's, loaded normally)."""
    for name, layer_state in stored.items():
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        float_layer = getattr(parent, child)
        setattr(parent, child, stored_to_layer(layer_state, float_layer))
    return module


def stored_to_layer(stored: StoredLayer, float_layer: torch.nn.Module) -> torch.nn.Module:
    """The quantized layer for `stored`, shaped and configured like `float_layer` (a Linear or Conv2d)."""
    bias = getattr(float_layer, "bias", None)
    bias = None if bias is None else bias.detach()
    if isinstance(float_layer, torch.nn.Conv2d):  # its shape from its settings: a loader may not have filled its weight
        _check_shape(stored, (float_layer.out_channels, float_layer.in_channels // float_layer.groups,
                              *float_layer.kernel_size), float_layer)
        return QuantConv2d(stored.scheme, stored.weight, stored.scale, bias, float_layer.stride, float_layer.padding,
                           float_layer.dilation, float_layer.groups, float_layer.padding_mode)
    if isinstance(float_layer, torch.nn.Linear):
        _check_shape(stored, (float_layer.out_features, float_layer.in_features), float_layer)
        return QuantLinear(stored.scheme, stored.weight, stored.scale, bias)
    raise QuantizeError(f"a quantized weight for a {type(float_layer).__name__}: Kiln quantizes Linear and Conv2d only")


def load(module: torch.nn.Module, path: str) -> torch.nn.Module:
    """Load a Kiln (or ComfyUI fp8) quantized file into `module`, a float model of the same
    architecture (its own weights are replaced; the quantized layers are swapped in)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        state_dict = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata() or {}
    stored = split_quantized(state_dict)
    result = module.load_state_dict(state_dict, strict=False)
    expected_missing = {f"{name}.weight" for name in stored}
    missing = [k for k in result.missing_keys if k not in expected_missing]
    if missing or result.unexpected_keys:
        raise QuantizeError(f"{path} does not fit {type(module).__name__}: missing {missing[:5]}, "
                            f"unexpected {result.unexpected_keys[:5]}")
    install(module, stored)
    if METADATA_KEY in metadata:
        module.kiln_quant_report = QuantReport(**json.loads(metadata[METADATA_KEY]))
    return module


def _check_shape(stored: StoredLayer, shape, layer) -> None:
    if tuple(stored.weight.shape) != tuple(shape):
        raise QuantizeError(f"a quantized weight of shape {tuple(stored.weight.shape)} for a "
                            f"{type(layer).__name__} of shape {tuple(shape)}")


def _json_tensor(value: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value).encode("utf-8")), dtype=torch.uint8)
