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

A file is untrusted (models are downloaded from strangers): `check_stored_layer` checks every
quantized layer's tensors before Kiln uses them, and any mismatch is a QuantizeError naming the
layer (and, from `load` and Kiln › Load Quantized Model, the file). Nothing is cast or repaired.
`save` writes a hidden temporary file beside the target and moves it into place, so a failed save
leaves an existing file as it was and never a partial `.safetensors` in ComfyUI's model list.
"""
from __future__ import annotations

import contextlib
import json
import os
import reprlib
import secrets
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .layers import QuantConv2d, QuantLinear, quantized_layers
from .report import QuantReport
from .scheme import SCHEMES, QuantizeError, Scheme

FORMAT_KEYS = ("comfy_quant", "kiln_quant")
_BY_FORMAT = {s.file_format: s for s in SCHEMES.values()}
METADATA_KEY = "kiln_quant"
MARKER_MAX_BYTES = 4096  # a marker is a few dozen bytes of JSON ({"format": "kiln_int8_weight"})
TEMP_INFIX = ".kiln-tmp-"  # `save`'s temporary files: .<name>.kiln-tmp-<hex>, hidden, not .safetensors

_short = reprlib.Repr()  # values from a file, shortened for error messages
_short.maxstring = _short.maxother = 60


@dataclass
class StoredLayer:
    """One quantized layer read from a file: its scheme, stored weight and scale."""

    scheme: Scheme
    weight: torch.Tensor
    scale: torch.Tensor
    ignored: tuple[str, ...] = ()
    layer: str = ""  # its name in the file, for errors


def quantized_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict with each quantized layer's format marker added: what `save` writes."""
    sd = {k: v.contiguous() for k, v in module.state_dict().items()}
    for name, layer in quantized_layers(module).items():
        sd[f"{name}.{layer.scheme.file_key}"] = _json_tensor({"format": layer.scheme.file_format})
    return sd


def save(module: torch.nn.Module, path: str, metadata: Optional[dict[str, str]] = None) -> None:
    """Write a quantized module (from `quantize`) to a safetensors file, atomically (see write_atomically)."""
    from safetensors.torch import save_file

    if not quantized_layers(module):
        raise QuantizeError(f"{type(module).__name__} has no Kiln-quantized layers: nothing to save as a quantized model")
    meta = dict(metadata or {})
    report = getattr(module, "kiln_quant_report", None)
    if isinstance(report, QuantReport):
        meta[METADATA_KEY] = json.dumps(report.as_dict())
    tensors = quantized_state_dict(module)
    write_atomically(path, lambda temp: save_file(tensors, temp, metadata=meta))


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(temp)` to a new hidden file beside `path` (.<name>.kiln-tmp-<hex>), fsync it, then move it
    onto `path` in one step. On any failure the temporary file is removed and an existing `path` is
    untouched; a crash leaves at most the hidden temporary file, never a partial `path`."""
    folder, name = os.path.split(os.path.abspath(path))
    temp = os.path.join(folder, f".{name}{TEMP_INFIX}{secrets.token_hex(8)}")
    os.close(os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # ours alone; the umask applies
    try:
        write(temp)
        _fsync(temp)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if os.name == "posix":  # the rename itself survives a power cut (Windows cannot open a folder to sync it)
        _fsync(folder, os.O_RDONLY)


def _fsync(path: str, flags: int = os.O_RDWR) -> None:  # O_RDWR: Windows syncs only files open for writing
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pop_quantized_layer(state_dict: dict, prefix: str) -> Optional[StoredLayer]:
    """Take the quantized layer at `prefix` ("input_blocks.1.1.proj_in.") out of `state_dict`, checked
    (check_stored_layer): its weight, scale and markers are removed, its bias is left. None if that
    layer is not quantized."""
    markers = {key: state_dict.pop(f"{prefix}{key}") for key in FORMAT_KEYS if f"{prefix}{key}" in state_dict}
    if not markers:
        return None
    layer = prefix.rstrip(".")
    if len(markers) > 1:
        raise QuantizeError(f"layer {layer} has two format markers, {' and '.join(markers)}; a quantized layer has one")
    marker_key, marker = next(iter(markers.items()))
    weight = state_dict.pop(f"{prefix}weight", None)
    scale = state_dict.pop(f"{prefix}weight_scale", None)
    ignored = tuple(k for k in ("input_scale",) if state_dict.pop(f"{prefix}{k}", None) is not None)
    return check_stored_layer(layer, marker_key, marker, weight, scale, ignored)


def check_stored_layer(layer: str, marker_key: str, marker, weight, scale,
                       ignored: tuple[str, ...] = ()) -> StoredLayer:
    """The StoredLayer for quantized layer `layer`'s tensors as read from a file, each checked, nothing
    cast: the marker (`<layer>.<marker_key>`) is a 1-D uint8 tensor of at most MARKER_MAX_BYTES of UTF-8
    JSON, a mapping whose "format" Kiln loads; the weight is a Linear (2-D) or Conv2d (4-D) weight in
    exactly that format's storage dtype; the scale is floating point, finite and > 0, one per tensor
    (0-dim or (1,)) or one per output channel ((out,)) as the format says, or absent for fp8
    (ComfyUI's reading: 1). Anything else: QuantizeError naming the layer."""
    scheme = _marked_scheme(layer, marker_key, marker)
    if not isinstance(weight, torch.Tensor):
        raise QuantizeError(f"layer {layer} is marked quantized but the file has no {layer}.weight tensor")
    if weight.dtype != scheme.storage:
        raise QuantizeError(f"layer {layer}'s weight is stored as {weight.dtype}, but format {scheme.file_format!r} "
                            f"stores {scheme.storage}; Kiln does not convert it: the file is damaged or was rewritten "
                            f"by another tool, quantize and save the model again")
    if weight.dim() not in (2, 4):
        raise QuantizeError(f"layer {layer}'s weight has shape {tuple(weight.shape)}: Kiln quantizes Linear (2-D) "
                            f"and Conv2d (4-D) weights only")
    return StoredLayer(scheme, weight, _checked_scale(layer, scheme, scale, weight.shape[0]), ignored, layer)


def _marked_scheme(layer: str, marker_key: str, marker) -> Scheme:
    """The scheme a layer's format marker names (see check_stored_layer)."""
    what = f"layer {layer}'s format marker {layer}.{marker_key}"
    example = f'a 1-D uint8 tensor of UTF-8 JSON such as {{"format": "{next(iter(_BY_FORMAT))}"}}'
    if not (isinstance(marker, torch.Tensor) and marker.dtype == torch.uint8 and marker.dim() == 1):
        found = f"a {marker.dtype} tensor of shape {tuple(marker.shape)}" if isinstance(marker, torch.Tensor) \
            else _short.repr(marker)
        raise QuantizeError(f"{what} is {found}; a marker is {example}")
    if marker.numel() > MARKER_MAX_BYTES:
        raise QuantizeError(f"{what} is {marker.numel()} bytes; a marker is at most {MARKER_MAX_BYTES} bytes, "
                            f"{example}")
    raw = bytes(marker.tolist())
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise QuantizeError(f"{what} is not UTF-8: {_short.repr(raw)}; a marker is {example}") from None
    try:
        conf = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: 4 KiB of "[" nests deeper than Python recurses
        raise QuantizeError(f"{what} is not JSON: {_short.repr(text)}; a marker is {example}") from None
    if not isinstance(conf, dict):
        raise QuantizeError(f"{what} holds {_short.repr(conf)}, not a mapping; a marker is {example}")
    file_format = conf.get("format")
    scheme = _BY_FORMAT.get(file_format) if isinstance(file_format, str) else None
    if scheme is None:
        raise QuantizeError(f"layer {layer} is quantized as {_short.repr(file_format)}, which Kiln cannot load "
                            f"(Kiln loads {', '.join(_BY_FORMAT)}); load this file with ComfyUI's own loader")
    return scheme


def _checked_scale(layer: str, scheme: Scheme, scale, out: int) -> torch.Tensor:
    """`scale` as float32, 0-dim per tensor or (out,) per channel (see check_stored_layer)."""
    name = f"{layer}.weight_scale"
    if scale is None:
        if scheme.per_channel:
            raise QuantizeError(f"layer {layer} ({scheme.name}) has no {name}: its format needs one scale per "
                                f"output channel")
        return torch.ones((), dtype=torch.float32)  # ComfyUI reads a missing fp8 scale as 1
    if not (isinstance(scale, torch.Tensor) and scale.is_floating_point()):
        found = f"a {scale.dtype} tensor" if isinstance(scale, torch.Tensor) else _short.repr(scale)
        raise QuantizeError(f"layer {layer}'s {name} is {found}; a scale is a floating-point tensor")
    shapes = [(out,)] if scheme.per_channel else [(), (1,)]
    if tuple(scale.shape) not in shapes:
        needs = f"({out},), one per output channel" if scheme.per_channel else "() or (1,), one per tensor"
        raise QuantizeError(f"layer {layer}'s {name} has shape {tuple(scale.shape)}; format "
                            f"{scheme.file_format!r} needs {needs}")
    scale = scale.to(torch.float32).reshape(shapes[0])  # a float64 beyond float32's range becomes inf: refused below
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        first = scale.reshape(-1)[bad.reshape(-1)][0].item()
        raise QuantizeError(f"layer {layer}'s {name} has {int(bad.sum())} of {scale.numel()} values that are not "
                            f"finite and > 0 (such as {_short.repr(first)}); a scale is a weight's range / its "
                            f"largest stored value: the file is damaged")
    return scale


def split_quantized(state_dict: dict) -> dict[str, StoredLayer]:
    """Take every quantized layer out of `state_dict` (see pop_quantized_layer): {layer name: StoredLayer}."""
    markers = [key for key in state_dict if key.rpartition(".")[2] in FORMAT_KEYS]
    unnamed = [key for key in markers if "." not in key]
    if unnamed:
        raise QuantizeError(f"format marker {unnamed[0]!r} names no layer; a marker is <layer>.{unnamed[0]}")
    layers = dict.fromkeys(key.rpartition(".")[0] for key in markers)
    return {layer: pop_quantized_layer(state_dict, layer + ".") for layer in layers}


def install(module: torch.nn.Module, stored: dict[str, StoredLayer]) -> torch.nn.Module:
    """Replace each named float layer of `module` by the quantized layer read from a file (its bias
    is the float layer's, loaded normally)."""
    for name, layer_state in stored.items():
        parent_name, _, child = name.rpartition(".")
        try:
            float_layer = module.get_submodule(name)
        except AttributeError:
            raise QuantizeError(f"layer {name} is quantized in the file, but {type(module).__name__} has no layer "
                                f"of that name") from None
        setattr(module.get_submodule(parent_name), child, stored_to_layer(layer_state, float_layer))
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
    raise QuantizeError(f"layer {stored.layer}: a quantized weight for a {type(float_layer).__name__}: Kiln quantizes "
                        f"Linear and Conv2d only")


def load(module: torch.nn.Module, path: str) -> torch.nn.Module:
    """Load a Kiln (or ComfyUI fp8) quantized file into `module`, a float model of the same
    architecture (its own weights are replaced; the quantized layers are swapped in). A damaged
    file: QuantizeError naming the file and the layer."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        state_dict = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata() or {}
    try:
        stored = split_quantized(state_dict)
    except QuantizeError as error:
        raise QuantizeError(f"{path}: {error}") from error
    result = module.load_state_dict(state_dict, strict=False)
    expected_missing = {f"{name}.weight" for name in stored}
    missing = [k for k in result.missing_keys if k not in expected_missing]
    if missing or result.unexpected_keys:
        raise QuantizeError(f"{path} does not fit {type(module).__name__}: missing {missing[:5]}, "
                            f"unexpected {result.unexpected_keys[:5]}")
    try:
        install(module, stored)
    except QuantizeError as error:
        raise QuantizeError(f"{path}: {error}") from error
    if METADATA_KEY in metadata:
        module.kiln_quant_report = _report_from_metadata(metadata[METADATA_KEY], path)
    return module


def _report_from_metadata(text: str, path: str) -> QuantReport:
    try:
        return QuantReport(**json.loads(text))
    except (ValueError, TypeError, RecursionError):  # not JSON, not a mapping, or not QuantReport's fields
        raise QuantizeError(f"{path}: its metadata {METADATA_KEY!r} is not a Kiln quantization report: "
                            f"{_short.repr(text)}; remove that metadata entry or save the model again") from None


def _check_shape(stored: StoredLayer, shape, layer) -> None:
    if tuple(stored.weight.shape) != tuple(shape):
        raise QuantizeError(f"layer {stored.layer}: a quantized weight of shape {tuple(stored.weight.shape)} for a "
                            f"{type(layer).__name__} of shape {tuple(shape)}")


def _json_tensor(value: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value).encode("utf-8")), dtype=torch.uint8)
