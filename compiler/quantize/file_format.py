"""Quantized models in safetensors files (no pickle), in ComfyUI's per-layer layout.

Each quantized layer `<layer>` has, beside its usual keys (`<layer>.bias` in high precision):
- `<layer>.weight`: the stored weight, int8 (I8) or float8_e4m3fn (F8_E4M3), the layer's shape;
- `<layer>.weight_scale`: float32, per tensor (a 0-dim tensor: fp8_e4m3, int8_tensorwise) or per
  output channel (Kiln's int8 formats);
- a format marker: a uint8 tensor holding JSON. fp8_e4m3 and int8_tensorwise layers use ComfyUI's
  own key and value, `<layer>.comfy_quant` = {"format": "float8_e4m3fn" | "int8_tensorwise"}, so a
  stock ComfyUI that has the format loads Kiln's file; they are Linear layers only (ComfyUI's
  formats have no convolutions, and those schemes keep them in high precision). Kiln's per-channel
  int8 layers use Kiln's own key in the same style, `<layer>.kiln_quant` =
  {"format": "kiln_int8_weight" | "kiln_int8_dynamic"}; only Kiln loads those.
- ComfyUI's optional `<layer>.input_scale` (a static activation scale) is read and not used: Kiln
  scales activations per call, from their own range.
The file's metadata has "kiln_quant": the QuantReport (JSON) of the model it was saved from.

Kiln also reads ComfyUI's int8_tensorwise layers with a per-row (out, 1) scale, as Kiln's
per-channel int8_weight. A file with a layer in a format Kiln does not read (nvfp4, float8_e5m2,
int8_tensorwise with ConvRot rotation, ...) is for ComfyUI's own loader: `marked_formats` says what
each layer is, and `reader_for` whether Kiln, the running ComfyUI, or neither reads the file.

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
from typing import Callable, Collection, Optional

import torch

from .layers import QuantConv2d, QuantLinear, quantized_layers
from .report import QuantReport
from .scheme import SCHEMES, QuantizeError, Scheme

COMFY_KEY, KILN_KEY = "comfy_quant", "kiln_quant"  # the format marker's key: ComfyUI's formats, Kiln's own
FORMAT_KEYS = (COMFY_KEY, KILN_KEY)
_BY_FORMAT = {s.file_format: s for s in SCHEMES.values()}
# ComfyUI's int8_tensorwise also takes one scale per row, (out, 1): that layer is Kiln's per-channel int8_weight
_PER_ROW_AS = {"int8_tensorwise": SCHEMES["int8_weight"]}
# ComfyUI reads a missing float8 scale as 1; every other format needs its scale
_SCALE_MAY_BE_MISSING = {"float8_e4m3fn"}
# marker options that change what the stored weight means and that Kiln does not implement, per format
# (ComfyUI's int8_tensorwise "convrot": a Hadamard-rotated weight); a layer with one is for ComfyUI's loader
_OPTIONS_KILN_DOES_NOT_READ = {"int8_tensorwise": ("convrot",)}
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


@dataclass(frozen=True)
class MarkedFormat:
    """A quantized layer's format as its marker names it: `name` ("float8_e4m3fn", "nvfp4"), `marker_key`
    (comfy_quant or kiln_quant), and `option`: a marker option Kiln does not read ("convrot"; "" for none)."""

    name: str
    marker_key: str
    option: str = ""

    @property
    def kiln_reads(self) -> bool:
        return self.name in _BY_FORMAT and not self.option

    def comfyui_reads(self, comfyui_formats: Collection[str]) -> bool:
        """A ComfyUI whose comfy.quant_ops.QUANT_ALGOS lists `comfyui_formats` loads this layer
        (ComfyUI reads comfy_quant markers only)."""
        return self.marker_key == COMFY_KEY and self.name in comfyui_formats

    def __str__(self) -> str:  # the name is the file's: shortened, quoted
        return _short.repr(self.name) + (f" with {self.option}" if self.option else "")


READER_KILN, READER_COMFYUI = "kiln", "comfyui"  # reader_for's answers


def marked_formats(state_dict: dict) -> dict[str, MarkedFormat]:
    """{layer: its MarkedFormat} for every layer of `state_dict` with a format marker, each marker
    checked (see check_stored_layer; a damaged one is a QuantizeError naming the layer); nothing is removed."""
    formats = {}
    for key in state_dict:
        layer, _, marker_key = key.rpartition(".")
        if marker_key in FORMAT_KEYS:
            if not layer:
                raise QuantizeError(f"format marker {key!r} names no layer; a marker is <layer>.{key}")
            formats[layer] = _marked_format(layer, marker_key, state_dict[key])
    return formats


def reader_for(formats: dict[str, MarkedFormat], comfyui_formats: Collection[str], comfyui_version: str) -> str:
    """Who loads a file whose layers have `formats` (from marked_formats): READER_KILN when Kiln reads
    every layer; else READER_COMFYUI when the running ComfyUI (version `comfyui_version`, its
    QUANT_ALGOS listing `comfyui_formats`) reads every layer; else a QuantizeError naming a layer and
    its format."""
    kiln_cannot = {layer: f for layer, f in formats.items() if not f.kiln_reads}
    if not kiln_cannot:
        return READER_KILN
    comfyui_cannot = {layer: f for layer, f in formats.items() if not f.comfyui_reads(comfyui_formats)}
    if not comfyui_cannot:
        return READER_COMFYUI
    comfyui_has = ", ".join(sorted(comfyui_formats)) or "none"
    neither = [layer for layer in kiln_cannot if layer in comfyui_cannot]
    if neither:
        layer = neither[0]
        raise QuantizeError(f"layer {layer} is quantized as {kiln_cannot[layer]}, which neither Kiln (it reads "
                            f"{', '.join(_BY_FORMAT)}) nor this ComfyUI {comfyui_version} (its quantized formats: "
                            f"{comfyui_has}) reads")
    kiln_layer, comfyui_layer = next(iter(kiln_cannot)), next(iter(comfyui_cannot))
    raise QuantizeError(f"layer {kiln_layer} is quantized as {kiln_cannot[kiln_layer]}, which Kiln does not read, "
                        f"and this ComfyUI {comfyui_version} does not read layer {comfyui_layer}'s "
                        f"{comfyui_cannot[comfyui_layer]} (its quantized formats: {comfyui_has}): neither loads the file")


def readers(module: torch.nn.Module) -> str:
    """What loads the file `save` writes for `module`: its scheme's readers, one line per scheme when
    its quantized layers have several (a reader must then read them all)."""
    schemes = {layer.scheme.name: layer.scheme for layer in quantized_layers(module).values()}
    if len(schemes) == 1:
        return next(iter(schemes.values())).readers
    return "; ".join(f"{name} layers: {scheme.readers}" for name, scheme in schemes.items()) + \
        " (a reader must read every one)"


def quantized_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict with each quantized layer's format marker added: what `save` writes. A
    layer in one of ComfyUI's formats must be a Linear layer (ComfyUI would misread any other)."""
    sd = {k: v.contiguous() for k, v in module.state_dict().items()}
    for name, layer in quantized_layers(module).items():
        scheme = layer.scheme
        if scheme.comfyui_format and not isinstance(layer, QuantLinear):
            raise QuantizeError(f"layer {name} is a {type(layer).__name__} in {scheme.name}, whose file format "
                                f"{scheme.file_format!r} (ComfyUI's) holds Linear layers only; keep it in high "
                                f"precision or quantize it with int8_weight")
        sd[f"{name}.{scheme.file_key}"] = _json_tensor({"format": scheme.file_format})
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
    JSON, a mapping whose "format" Kiln loads (with no option Kiln does not read); the weight is a
    Linear (2-D) weight, or under Kiln's own key also a Conv2d (4-D) one, in exactly that format's
    storage dtype; the scale is floating point, finite and > 0, one per tensor (0-dim or (1,)) or one
    per output channel ((out,)) as the format says, for int8_tensorwise also one per row ((out, 1),
    loaded as int8_weight), or absent for float8_e4m3fn (ComfyUI's reading: 1). Anything else:
    QuantizeError naming the layer."""
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
    if weight.dim() != 2 and marker_key == COMFY_KEY:
        raise QuantizeError(f"layer {layer}'s weight has shape {tuple(weight.shape)}, but its marker "
                            f"{layer}.{COMFY_KEY} is ComfyUI's, whose formats hold Linear (2-D) weights only")
    scheme, scale = _checked_scale(layer, scheme, scale, weight.shape[0])
    return StoredLayer(scheme, weight, scale, ignored, layer)


def _marked_scheme(layer: str, marker_key: str, marker) -> Scheme:
    """The scheme a layer's format marker names (see check_stored_layer)."""
    marked = _marked_format(layer, marker_key, marker)
    if not marked.kiln_reads:
        raise QuantizeError(f"layer {layer} is quantized as {marked}, which Kiln cannot load (Kiln loads "
                            f"{', '.join(_BY_FORMAT)}); load this file with ComfyUI's own loader (Kiln › Load "
                            f"Quantized Model hands it to ComfyUI when ComfyUI reads its formats)")
    return _BY_FORMAT[marked.name]


def _marked_format(layer: str, marker_key: str, marker) -> MarkedFormat:
    """The format a layer's marker names, the marker checked (see check_stored_layer); a format
    Kiln does not know is returned, for the caller to refuse or hand on."""
    conf = _marker_conf(layer, marker_key, marker)
    file_format = conf.get("format")
    if not isinstance(file_format, str):
        raise QuantizeError(f"layer {layer} is quantized as {_short.repr(file_format)}, which Kiln cannot load "
                            f"(Kiln loads {', '.join(_BY_FORMAT)}): a marker's \"format\" is a format's name")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    # read as ComfyUI reads them: the marker's own key first, then its "params"
    unread = [o for o in _OPTIONS_KILN_DOES_NOT_READ.get(file_format, ()) if conf.get(o, params.get(o))]
    return MarkedFormat(file_format, marker_key, unread[0] if unread else "")


def _marker_conf(layer: str, marker_key: str, marker) -> dict:
    """A layer's format marker read as a JSON mapping (see check_stored_layer)."""
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
    return conf


def _scale_layouts(scheme: Scheme, out: int) -> dict[tuple, tuple[Scheme, tuple, str]]:
    """The scale shapes `scheme`'s format allows: {shape: (the scheme such a layer loads as, the shape
    Kiln keeps, what the shape means)}."""
    if scheme.per_channel:
        return {(out,): (scheme, (out,), f"({out},), one per output channel")}
    layouts = {(): (scheme, (), "() or (1,), one per tensor"), (1,): (scheme, (), "")}
    if scheme.file_format in _PER_ROW_AS:
        layouts[(out, 1)] = (_PER_ROW_AS[scheme.file_format], (out,), f"({out}, 1), one per row")
    return layouts


def _checked_scale(layer: str, scheme: Scheme, scale, out: int) -> tuple[Scheme, torch.Tensor]:
    """(the scheme the layer loads as, `scale` as float32 in that scheme's shape: 0-dim per tensor or
    (out,) per channel) (see check_stored_layer)."""
    name = f"{layer}.weight_scale"
    layouts = _scale_layouts(scheme, out)
    needs = " or ".join(meaning for _, _, meaning in layouts.values() if meaning)
    if scale is None:
        if scheme.file_format not in _SCALE_MAY_BE_MISSING:
            raise QuantizeError(f"layer {layer} ({scheme.file_format}) has no {name}: its format needs {needs}")
        return scheme, torch.ones((), dtype=torch.float32)  # ComfyUI reads a missing fp8 scale as 1
    if not (isinstance(scale, torch.Tensor) and scale.is_floating_point()):
        found = f"a {scale.dtype} tensor" if isinstance(scale, torch.Tensor) else _short.repr(scale)
        raise QuantizeError(f"layer {layer}'s {name} is {found}; a scale is a floating-point tensor")
    if tuple(scale.shape) not in layouts:
        raise QuantizeError(f"layer {layer}'s {name} has shape {tuple(scale.shape)}; format "
                            f"{scheme.file_format!r} needs {needs}")
    scheme, kept_shape, _ = layouts[tuple(scale.shape)]
    scale = scale.to(torch.float32).reshape(kept_shape)  # a float64 beyond float32's range becomes inf: refused below
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        first = scale.reshape(-1)[bad.reshape(-1)][0].item()
        raise QuantizeError(f"layer {layer}'s {name} has {int(bad.sum())} of {scale.numel()} values that are not "
                            f"finite and > 0 (such as {_short.repr(first)}); a scale is a weight's range / its "
                            f"largest stored value: the file is damaged")
    return scheme, scale


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
    """Load a Kiln quantized file (or one of ComfyUI's float8_e4m3fn or int8_tensorwise files) into
    `module`, a float model of the same architecture (its own weights are replaced; the quantized
    layers are swapped in). A damaged file: QuantizeError naming the file and the layer."""
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
