"""Quantized safetensors files (compiler/quantize/file_format.py) as untrusted input: every damaged
layer is refused with a QuantizeError naming the layer and the file, nothing is cast; a failed
save leaves an existing file as it was and no partial or temporary file behind."""
import json
import os
import random

import pytest
import safetensors.torch
import torch

import kiln
from kiln.compiler.quantize import (READER_COMFYUI, READER_KILN, SCHEMES, MarkedFormat, QuantConv2d, QuantizeError,
                                    QuantLinear, StoredLayer, marked_formats, pop_quantized_layer, quantized_layers,
                                    quantized_state_dict, reader_for, readers)
from kiln.compiler.quantize.file_format import MARKER_MAX_BYTES, TEMP_INFIX

ALL = "min_params: 0"  # the tiny model's layers are all under the default size threshold
CONV, LINEAR = "0", "2"  # the layers' names in `float_model`


def float_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 16))


def saved(tmp_path, scheme: str):
    """(path, tensors, metadata) of `float_model` quantized under `scheme` and saved."""
    quantized = kiln.quantize(float_model(), scheme, policy=ALL)
    path = str(tmp_path / f"{scheme}.safetensors")
    kiln.save_quantized(quantized, path)
    with safetensors.safe_open(path, "pt") as f:
        return path, {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def tampered(tmp_path, scheme: str, **changes):
    """The path of a saved `scheme` file with `changes` ({key with "/" for ".": tensor, or None to
    drop it}) written over its tensors."""
    path, tensors, metadata = saved(tmp_path, scheme)
    for key, value in changes.items():
        key = key.replace("/", ".")
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    return path


def marker(value) -> torch.Tensor:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode("utf-8")
    return torch.tensor(list(raw), dtype=torch.uint8)


def refused(path: str, layer: str, *words: str) -> str:
    """Load `path` into a float model: assert a QuantizeError naming the file, the layer and `words`."""
    with pytest.raises(QuantizeError) as caught:
        kiln.load_quantized(float_model(), path)
    message = str(caught.value)
    assert path in message and f"layer {layer}" in message, message
    for word in words:
        assert word in message, message
    return message


def test_a_saved_file_loads_back_with_identical_outputs(tmp_path):
    x = torch.randn(2, 4, 4, 4)
    for scheme in ("int8_weight", "fp8_e4m3", "int8_tensorwise"):
        quantized = kiln.quantize(float_model(), scheme, policy=ALL)
        path = str(tmp_path / f"{scheme}.safetensors")
        kiln.save_quantized(quantized, path)
        loaded = kiln.load_quantized(float_model(), path)
        assert quantized_layers(loaded).keys() == quantized_layers(quantized).keys()
        assert torch.equal(loaded(x), quantized(x))
        assert loaded.kiln_quant_report.quantized == quantized.kiln_quant_report.quantized


def test_an_int8_tensorwise_file_is_comfyuis_layout_with_convolutions_kept_in_float(tmp_path):
    """What ComfyUI 0.33's loader reads: <layer>.weight int8 of the layer's shape, a 0-dim float32
    weight_scale and comfy_quant {"format": "int8_tensorwise"}; the convolution (ComfyUI's formats
    have Linear layers only) stays a plain float layer with no marker."""
    path, tensors, _ = saved(tmp_path, "int8_tensorwise")
    assert tensors[f"{LINEAR}.weight"].dtype == torch.int8 and tensors[f"{LINEAR}.weight"].shape == (16, 128)
    scale = tensors[f"{LINEAR}.weight_scale"]
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert json.loads(bytes(tensors[f"{LINEAR}.comfy_quant"].tolist())) == {"format": "int8_tensorwise"}
    assert tensors[f"{CONV}.weight"].dtype == torch.float32
    assert not [k for k in tensors if k.startswith(f"{CONV}.") and k.endswith(("_quant", "_scale"))]
    loaded = kiln.load_quantized(float_model(), path)
    assert {n: type(m) for n, m in quantized_layers(loaded).items()} == {LINEAR: QuantLinear}
    assert loaded.get_submodule(LINEAR).scheme_name == "int8_tensorwise"


def test_the_report_and_readers_say_what_loads_the_file():
    quantized = kiln.quantize(float_model(), "int8_tensorwise", policy=ALL)
    assert readers(quantized) == SCHEMES["int8_tensorwise"].readers
    summary = kiln.quant_report(quantized).summary()
    assert "the file loads in: ComfyUI with int8_tensorwise (0.33.0 has it; 0.8.0 does not) and Kiln" in summary
    assert "convolution (ComfyUI's int8_tensorwise format has Linear layers only): 1" in summary


def test_a_model_mixing_schemes_lists_each_schemes_readers():
    module = float_model()
    module[0] = QuantConv2d.from_float(module[0], SCHEMES["int8_weight"])
    module[2] = QuantLinear.from_float(module[2], SCHEMES["int8_tensorwise"])
    assert readers(module) == (f"int8_weight layers: {SCHEMES['int8_weight'].readers}; int8_tensorwise layers: "
                               f"{SCHEMES['int8_tensorwise'].readers} (a reader must read every one)")


@pytest.mark.parametrize("scheme", ["int8_tensorwise", "fp8_e4m3"])
def test_a_convolution_is_never_saved_in_a_comfyui_format(scheme):
    """Stock ComfyUI has no quantized convolution: it would load such a layer's stored values as weights."""
    module = float_model()
    module[0] = QuantConv2d.from_float(module[0], SCHEMES[scheme])
    with pytest.raises(QuantizeError, match=f"layer {CONV} is a QuantConv2d in {scheme}, whose file format .* "
                                            "holds Linear layers only"):
        quantized_state_dict(module)


# ---- ComfyUI's int8_tensorwise layers ---------------------------------------------------------

def comfy_int8_layer(scale, **extra) -> dict:
    sd = {"l.weight": torch.randint(-127, 128, (16, 32), dtype=torch.int8),
          "l.comfy_quant": marker({"format": "int8_tensorwise", **extra})}
    if scale is not None:
        sd["l.weight_scale"] = scale
    return sd


@pytest.mark.parametrize("scale, expected", [
    (torch.tensor(0.25), torch.tensor(0.25)),  # what ComfyUI writes: 0-dim float32
    (torch.tensor([0.25]), torch.tensor(0.25)),
    (torch.tensor(0.25, dtype=torch.float16), torch.tensor(0.25)),
])
def test_comfyuis_per_tensor_int8_layers_load_as_int8_tensorwise(scale, expected):
    sd = comfy_int8_layer(scale, full_precision_matrix_mult=True)
    stored = pop_quantized_layer(sd, "l.")
    assert stored.scheme.name == "int8_tensorwise" and stored.scale.dtype == torch.float32
    assert torch.equal(stored.scale, expected) and not sd


def test_comfyuis_per_row_int8_layers_load_as_kilns_per_channel_int8():
    """ComfyUI's int8_tensorwise also takes one scale per row, (out, 1): the same math as int8_weight."""
    row_scale = torch.rand(16, 1) + 0.01
    sd = comfy_int8_layer(row_scale)
    weight = sd["l.weight"]
    stored = pop_quantized_layer(sd, "l.")
    assert stored.scheme.name == "int8_weight" and stored.scale.shape == (16,)
    layer = QuantLinear(stored.scheme, stored.weight, stored.scale, None)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), x @ (weight.float() * row_scale).t())  # ComfyUI's q.float() * scale


def test_a_saved_int8_tensorwise_layer_is_what_comfyui_dequantizes():
    quantized = kiln.quantize(float_model(), "int8_tensorwise", policy=ALL)
    sd = quantized_state_dict(quantized)
    layer = quantized.get_submodule(LINEAR)
    torch.testing.assert_close(sd[f"{LINEAR}.weight"].float() * sd[f"{LINEAR}.weight_scale"], layer.dequantized_weight())


def test_an_int8_tensorwise_weight_of_another_dtype_is_refused(tmp_path):
    _, tensors, _ = saved(tmp_path, "int8_tensorwise")
    as_float = tensors[f"{LINEAR}.weight"].float() * tensors[f"{LINEAR}.weight_scale"]
    path = tampered(tmp_path, "int8_tensorwise", **{f"{LINEAR}/weight": as_float})
    refused(path, LINEAR, "torch.float32", "torch.int8", "'int8_tensorwise'")
    fp8 = tensors[f"{LINEAR}.weight"].float().to(torch.float8_e4m3fn)
    path = tampered(tmp_path, "int8_tensorwise", **{f"{LINEAR}/weight": fp8})
    refused(path, LINEAR, "torch.float8_e4m3fn", "torch.int8")


@pytest.mark.parametrize("shape", [(16,), (8, 1), (16, 2), (1, 16), (2,)])
def test_an_int8_tensorwise_scale_of_another_shape_is_refused(tmp_path, shape):
    """(16,) too: ComfyUI would broadcast a 1-D scale along the input, not the output channels."""
    path = tampered(tmp_path, "int8_tensorwise", **{f"{LINEAR}/weight_scale": torch.ones(shape)})
    refused(path, LINEAR, str(shape), "() or (1,), one per tensor or (16, 1), one per row")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-row"])
def test_an_int8_tensorwise_scale_that_is_not_finite_and_positive_is_refused(tmp_path, bad, per_row):
    scale = torch.full((16, 1), 0.01) if per_row else torch.tensor(0.01)
    scale.view(-1)[-1] = bad
    path = tampered(tmp_path, "int8_tensorwise", **{f"{LINEAR}/weight_scale": scale})
    refused(path, LINEAR, f"1 of {scale.numel()} values", "not finite and > 0", repr(bad))


def test_a_missing_int8_tensorwise_scale_is_refused(tmp_path):
    """ComfyUI's loader refuses it too ("Missing INT8 weight scale"); only fp8 reads a missing scale as 1."""
    path = tampered(tmp_path, "int8_tensorwise", **{f"{LINEAR}/weight_scale": None})
    refused(path, LINEAR, f"no {LINEAR}.weight_scale", "int8_tensorwise")


def test_a_comfyui_marker_on_a_convolution_is_refused(tmp_path):
    """ComfyUI's formats have no 4-D weights: a file that marks a convolution comfy_quant is not ComfyUI's."""
    _, tensors, _ = saved(tmp_path, "int8_weight")
    path = tampered(tmp_path, "int8_weight", **{f"{CONV}/kiln_quant": None,
                                                f"{CONV}/weight_scale": tensors[f"{CONV}.weight_scale"].amax(),
                                                f"{CONV}/comfy_quant": marker({"format": "int8_tensorwise"})})
    refused(path, CONV, "(8, 4, 3, 3)", "Linear (2-D) weights only")


@pytest.mark.parametrize("option", [{"convrot": True}, {"params": {"convrot": True}}], ids=["top-level", "params"])
def test_a_rotated_int8_tensorwise_layer_is_not_read_as_a_plain_one(option):
    """ComfyUI's ConvRot variant stores a Hadamard-rotated weight: read as plain int8 it would be garbage."""
    with pytest.raises(QuantizeError, match="layer l is quantized as 'int8_tensorwise' with convrot, which Kiln cannot "
                                            "load"):
        pop_quantized_layer(comfy_int8_layer(torch.tensor(0.1), **option), "l.")


def test_the_rotation_option_is_read_as_comfyui_reads_it():
    """ComfyUI: the marker's own "convrot" first, then its "params"."""
    stored = pop_quantized_layer(comfy_int8_layer(torch.tensor(0.1), convrot=False, params={"convrot": True}), "l.")
    assert stored.scheme.name == "int8_tensorwise"


# ---- who reads a file: Kiln, the running ComfyUI, or neither ----------------------------------

COMFYUI_0_8 = ("float8_e4m3fn", "float8_e5m2", "nvfp4")
COMFYUI_0_33 = COMFYUI_0_8 + ("mxfp8", "int8_tensorwise", "convrot_w4a4", "asym_w4a8_int8")


def file_with(**layers) -> dict:
    """A state dict whose layer <name> carries the marker {"format": value} under comfy_quant, or under
    kiln_quant for a value starting with "kiln_"; a tuple value adds the marker's options."""
    sd = {}
    for name, value in layers.items():
        file_format, options = value if isinstance(value, tuple) else (value, {})
        key = "kiln_quant" if file_format.startswith("kiln_") else "comfy_quant"
        sd[f"{name}.{key}"] = marker({"format": file_format, **options})
        sd[f"{name}.weight"] = torch.zeros(2, 2, dtype=torch.int8)
    return sd


def test_marked_formats_reads_each_marker_and_takes_nothing_out():
    sd = file_with(a="float8_e4m3fn", b="kiln_int8_weight", c=("int8_tensorwise", {"convrot": True}), d="nvfp4")
    keys = list(sd)
    assert marked_formats(sd) == {"a": MarkedFormat("float8_e4m3fn", "comfy_quant"),
                                  "b": MarkedFormat("kiln_int8_weight", "kiln_quant"),
                                  "c": MarkedFormat("int8_tensorwise", "comfy_quant", "convrot"),
                                  "d": MarkedFormat("nvfp4", "comfy_quant")}
    assert list(sd) == keys


def test_marked_formats_refuses_a_damaged_marker_naming_the_layer():
    sd = file_with(a="float8_e4m3fn")
    sd["b.comfy_quant"] = marker(b"\xff")
    with pytest.raises(QuantizeError, match="layer b's format marker b.comfy_quant is not UTF-8"):
        marked_formats(sd)


@pytest.mark.parametrize("layers, comfyui_formats, reader", [
    ({"a": "float8_e4m3fn", "b": "int8_tensorwise", "c": "kiln_int8_dynamic"}, COMFYUI_0_8, READER_KILN),
    ({"a": "float8_e4m3fn", "b": "int8_tensorwise"}, COMFYUI_0_33, READER_KILN),  # Kiln first when it reads them all
    ({"a": "float8_e5m2"}, COMFYUI_0_8, READER_COMFYUI),
    ({"a": "float8_e4m3fn", "b": "nvfp4", "c": "mxfp8"}, COMFYUI_0_33, READER_COMFYUI),
    ({"a": ("int8_tensorwise", {"convrot": True})}, COMFYUI_0_33, READER_COMFYUI),
    ({}, COMFYUI_0_8, READER_KILN),
])
def test_reader_for(layers, comfyui_formats, reader):
    assert reader_for(marked_formats(file_with(**layers)), comfyui_formats, "0.33.0") == reader


@pytest.mark.parametrize("layers, comfyui_formats, words", [
    ({"a": "float8_e4m3fn", "b": "mxfp8"}, COMFYUI_0_8,
     ("layer b is quantized as 'mxfp8', which neither Kiln (it reads kiln_int8_weight", "nor this ComfyUI 0.8.0 "
      "(its quantized formats: float8_e4m3fn, float8_e5m2, nvfp4) reads")),
    ({"a": ("int8_tensorwise", {"convrot": True})}, COMFYUI_0_8,
     ("layer a is quantized as 'int8_tensorwise' with convrot, which neither Kiln",)),
    ({"a": "kiln_nvfp4"}, COMFYUI_0_33, ("layer a is quantized as 'kiln_nvfp4', which neither Kiln",)),
    ({"a": "kiln_int8_weight", "b": "float8_e5m2"}, COMFYUI_0_33,
     ("layer b is quantized as 'float8_e5m2', which Kiln does not read, and this ComfyUI 0.8.0 does not read "
      "layer a's 'kiln_int8_weight'", "neither loads the file")),
    ({"a": "float8_e5m2"}, (), ("its quantized formats: none",)),
])
def test_a_file_neither_reads_is_refused_naming_the_layer_the_format_and_the_comfyui(layers, comfyui_formats, words):
    with pytest.raises(QuantizeError) as caught:
        reader_for(marked_formats(file_with(**layers)), comfyui_formats, "0.8.0")
    for word in words:
        assert word in str(caught.value), str(caught.value)


# ---- damaged weights --------------------------------------------------------------------------

def test_an_int8_weight_stored_as_float32_is_refused_not_cast(tmp_path):
    """Before: `weight.to(int8)` truncated the float values, an output 250x off, silently."""
    _, tensors, _ = saved(tmp_path, "int8_weight")
    as_float = tensors[f"{LINEAR}.weight"].float() * tensors[f"{LINEAR}.weight_scale"][:, None]
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight": as_float})
    refused(path, LINEAR, "torch.float32", "torch.int8", "kiln_int8_weight")


def test_an_fp8_weight_stored_as_int8_is_refused(tmp_path):
    _, tensors, _ = saved(tmp_path, "fp8_e4m3")
    path = tampered(tmp_path, "fp8_e4m3", **{f"{LINEAR}/weight": tensors[f"{LINEAR}.weight"].view(torch.int8)})
    refused(path, LINEAR, "torch.int8", "torch.float8_e4m3fn")


def test_a_weight_that_is_not_2d_or_4d_is_refused(tmp_path):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight": torch.zeros(16 * 128, dtype=torch.int8),
                                                f"{LINEAR}/weight_scale": torch.ones(16 * 128)})
    refused(path, LINEAR, "(2048,)", "Linear (2-D)")


def test_a_marked_layer_without_a_weight_is_refused(tmp_path):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight": None})
    refused(path, LINEAR, f"no {LINEAR}.weight")


def test_a_weight_that_does_not_fit_the_model_is_refused(tmp_path):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight": torch.zeros(16, 64, dtype=torch.int8)})
    refused(path, LINEAR, "(16, 64)", "(16, 128)")


# ---- damaged scales ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
def test_a_scale_that_is_not_finite_and_positive_is_refused(tmp_path, bad):
    """Before: a NaN (or zero, or negative) scale loaded, and every output of the layer was garbage."""
    _, tensors, _ = saved(tmp_path, "int8_weight")
    scale = tensors[f"{CONV}.weight_scale"].clone()
    scale[3] = bad
    path = tampered(tmp_path, "int8_weight", **{f"{CONV}/weight_scale": scale})
    refused(path, CONV, "1 of 8 values", "not finite and > 0", repr(bad))


def test_a_per_tensor_scale_that_is_not_finite_is_refused(tmp_path):
    path = tampered(tmp_path, "fp8_e4m3", **{f"{LINEAR}/weight_scale": torch.tensor(float("nan"))})
    refused(path, LINEAR, "not finite and > 0")


def test_a_float64_scale_beyond_float32s_range_is_refused(tmp_path):
    huge = torch.full((16,), 1e300, dtype=torch.float64)
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight_scale": huge})
    refused(path, LINEAR, "16 of 16 values", "inf")


@pytest.mark.parametrize("scheme, layer, shape, needs", [
    ("int8_weight", LINEAR, (15,), "(16,), one per output channel"),
    ("int8_weight", LINEAR, (), "(16,), one per output channel"),
    ("int8_weight", CONV, (8, 1), "(8,), one per output channel"),
    ("fp8_e4m3", LINEAR, (16,), "() or (1,), one per tensor"),
])
def test_a_wrong_shaped_scale_is_refused(tmp_path, scheme, layer, shape, needs):
    """Before: it loaded and failed at the first forward, or broadcast silently."""
    path = tampered(tmp_path, scheme, **{f"{layer}/weight_scale": torch.ones(shape)})
    refused(path, layer, str(shape), needs)


def test_a_scale_that_is_not_floating_point_is_refused(tmp_path):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight_scale": torch.ones(16, dtype=torch.int32)})
    refused(path, LINEAR, "torch.int32", "floating-point")


def test_a_missing_per_channel_scale_is_refused(tmp_path):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/weight_scale": None})
    refused(path, LINEAR, f"no {LINEAR}.weight_scale")


# ---- damaged format markers -------------------------------------------------------------------

@pytest.mark.parametrize("value, words", [
    (b"\xff\xfe{", ("2.kiln_quant", "not UTF-8", r"\xff")),
    (b'{"format": kiln_int8_weight}', ("2.kiln_quant", "not JSON", "kiln_int8_weight")),
    (b"[" * MARKER_MAX_BYTES, ("2.kiln_quant", "not JSON")),  # nests deeper than Python recurses
    (["kiln_int8_weight"], ("2.kiln_quant", "not a mapping", "['kiln_int8_weight']")),
    (3, ("2.kiln_quant", "not a mapping", "3")),
    ({"format": "nvfp4"}, ("'nvfp4'", "Kiln cannot load", "ComfyUI's own loader")),
    ({"format": ["kiln_int8_weight"]}, ("['kiln_int8_weight']", "Kiln cannot load")),
    ({"scheme": "int8_weight"}, ("None", "Kiln cannot load")),
], ids=["non-utf8", "non-json", "deep-json", "list", "number", "unknown-format", "format-not-a-string", "no-format"])
def test_a_damaged_marker_is_refused(tmp_path, value, words):
    """Before: a raw UnicodeDecodeError / JSONDecodeError / AttributeError / TypeError naming neither
    the layer nor the file."""
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/kiln_quant": marker(value)})
    refused(path, LINEAR, *words)


def test_an_oversized_marker_is_refused_unread(tmp_path):
    big = marker({"format": "kiln_int8_weight", "padding": "x" * MARKER_MAX_BYTES})
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/kiln_quant": big})
    refused(path, LINEAR, f"{big.numel()} bytes", f"at most {MARKER_MAX_BYTES}")


@pytest.mark.parametrize("bad", [marker({"format": "kiln_int8_weight"}).to(torch.int32),
                                 marker({"format": "kiln_int8_weight"}).reshape(1, -1)], ids=["int32", "2-d"])
def test_a_marker_that_is_not_a_1d_uint8_tensor_is_refused(tmp_path, bad):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/kiln_quant": bad})
    refused(path, LINEAR, f"{bad.dtype} tensor of shape {tuple(bad.shape)}")


def test_a_layer_with_two_markers_is_refused(tmp_path):
    path = tampered(tmp_path, "int8_weight", **{f"{LINEAR}/comfy_quant": marker({"format": "float8_e4m3fn"})})
    refused(path, LINEAR, "comfy_quant and kiln_quant")


def test_a_marker_for_a_layer_the_model_lacks_is_refused(tmp_path):
    _, tensors, _ = saved(tmp_path, "int8_weight")
    extra = {f"9/{key}": tensors[f"{LINEAR}.{key}"] for key in ("weight", "weight_scale", "kiln_quant")}
    path = tampered(tmp_path, "int8_weight", **extra)
    refused(path, "9", "has no layer of that name")


def test_damaged_report_metadata_names_the_file(tmp_path):
    path, tensors, metadata = saved(tmp_path, "int8_weight")
    safetensors.torch.save_file(tensors, path, metadata={**metadata, "kiln_quant": '["not", "a report"]'})
    with pytest.raises(QuantizeError, match="not a Kiln quantization report") as caught:
        kiln.load_quantized(float_model(), path)
    assert path in str(caught.value)


# ---- ComfyUI's own fp8 layers still load ------------------------------------------------------

def comfy_fp8_layer(**extra) -> dict:
    weight = torch.randn(16, 32).to(torch.float8_e4m3fn)
    return {"l.weight": weight, "l.comfy_quant": marker({"format": "float8_e4m3fn"}), **extra}


@pytest.mark.parametrize("scale, expected", [
    (torch.tensor(0.25), torch.tensor(0.25)),  # what ComfyUI writes: 0-dim float32
    (torch.tensor([0.25]), torch.tensor(0.25)),
    (torch.tensor(0.25, dtype=torch.bfloat16), torch.tensor(0.25)),
    (None, torch.tensor(1.0)),  # ComfyUI reads a missing fp8 scale as 1
])
def test_comfyuis_fp8_layers_load(scale, expected):
    sd = comfy_fp8_layer(**{"l.input_scale": torch.tensor(0.5), "l.bias": torch.zeros(16)})
    if scale is not None:
        sd["l.weight_scale"] = scale
    stored = pop_quantized_layer(sd, "l.")
    assert stored.scheme.name == "fp8_e4m3" and stored.ignored == ("input_scale",) and stored.layer == "l"
    assert stored.scale.dtype == torch.float32 and torch.equal(stored.scale, expected)
    assert list(sd) == ["l.bias"]  # its bias is left for the float layer's own loading


# ---- fuzz: only QuantizeError comes out -------------------------------------------------------

def random_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null", "format"] + (["list", "dict", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        keys = ["format", "full_precision_matrix_mult", "", "x" * rng.randint(1, 5)]
        return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return {"int": lambda: rng.randint(-2 ** 70, 2 ** 70), "float": lambda: rng.choice([rng.random(), float("nan")]),
            "str": lambda: "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 8))),
            "bool": lambda: rng.random() < 0.5, "null": lambda: None,
            "format": lambda: rng.choice(["kiln_int8_weight", "kiln_int8_dynamic", "float8_e4m3fn", "int8_tensorwise",
                                          "float8_e5m2", "nvfp4", "Kiln"]),
            }[kind]()


def random_marker(rng: random.Random) -> torch.Tensor:
    if rng.random() < 0.5:
        raw = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 40, 300, MARKER_MAX_BYTES + 1])))
        return torch.tensor(list(raw), dtype=torch.uint8)
    value = random_json(rng)
    if rng.random() < 0.5:
        value = {"format": value}
    tensor = marker(value)
    return tensor if rng.random() < 0.9 else tensor.to(rng.choice([torch.int8, torch.float32])).reshape(1, -1)


def random_tensor(rng: random.Random, shapes) -> torch.Tensor:
    dtype = rng.choice([torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float16, torch.float32, torch.float64])
    shape = rng.choice(shapes)
    values = rng.choice([torch.randn, lambda s: torch.rand(s) + 0.01, torch.zeros,
                         lambda s: torch.full(s, float("nan")), lambda s: torch.randn(s).double() * 1e300])(shape)
    return values.to(dtype)


def random_layer(rng: random.Random, prefix: str) -> dict:
    """Half the cases: a random marker on a sound int8 layer; the others: a sound marker of a random
    scheme on a random weight and scale (sometimes missing)."""
    if rng.random() < 0.5:
        return {f"{prefix}{rng.choice(['kiln_quant', 'comfy_quant'])}": random_marker(rng),
                f"{prefix}weight": torch.randint(-127, 128, (8, 4), dtype=torch.int8),
                f"{prefix}weight_scale": torch.rand(8) + 0.01}
    scheme = rng.choice(list(SCHEMES.values()))
    sd = {f"{prefix}{scheme.file_key}": marker({"format": scheme.file_format})}
    if rng.random() < 0.95:
        sd[f"{prefix}weight"] = random_tensor(rng, [(8, 4), (8, 4, 3, 3), (8,), ()])
    if rng.random() < 0.9:
        sd[f"{prefix}weight_scale"] = random_tensor(rng, [(), (1,), (8,), (4,), (8, 1)])
    return sd


def test_fuzzed_layers_raise_only_quantize_error():
    """600 layers with random marker bytes, random JSON markers and random weights and scales
    (fixed seed): each loads checked or is refused with a QuantizeError naming the layer; nothing else."""
    rng = random.Random(20260101)
    torch.manual_seed(0)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(600):
        sd = random_layer(rng, f"blocks.{case}.")
        try:
            stored = pop_quantized_layer(sd, f"blocks.{case}.")
        except QuantizeError as error:
            assert f"layer blocks.{case}" in str(error)
            outcomes["refused"] += 1
        else:
            assert isinstance(stored, StoredLayer) and stored.weight.dtype == stored.scheme.storage
            assert stored.scale.dtype == torch.float32 and stored.scale.dim() == int(stored.scheme.per_channel)
            assert bool(torch.isfinite(stored.scale).all()) and bool((stored.scale > 0).all())
            outcomes["loaded"] += 1
    assert outcomes["refused"] > 300 and outcomes["loaded"] > 0, outcomes  # both paths reached (595 and 5)


# ---- saving is atomic -------------------------------------------------------------------------

def quantized_model():
    return kiln.quantize(float_model(), "int8_weight", policy=ALL)


def failing_after_part(monkeypatch, written: list):
    """Make safetensors' writer write half a file to the path it is given, then fail (a full disk)."""
    real = safetensors.torch.save_file

    def half_then_fail(tensors, path, metadata=None):
        written.append(path)
        real(tensors, path, metadata=metadata)
        os.truncate(path, os.path.getsize(path) // 2)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)


def test_a_failed_save_leaves_the_old_file_byte_identical_and_no_temp_file(tmp_path, monkeypatch):
    """Before: with overwrite on, a failure half way destroyed the old file."""
    path = tmp_path / "model.safetensors"
    kiln.save_quantized(quantized_model(), str(path))
    before = path.read_bytes()
    written = []
    failing_after_part(monkeypatch, written)
    with pytest.raises(OSError, match="No space left"):
        kiln.save_quantized(kiln.quantize(float_model(), "fp8_e4m3", policy=ALL), str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert os.path.dirname(written[0]) == str(tmp_path)


def test_a_failed_save_to_a_new_name_leaves_no_partial_file(tmp_path, monkeypatch):
    """Before: a full disk left a partial .safetensors that showed in ComfyUI's model list."""
    written = []
    failing_after_part(monkeypatch, written)
    with pytest.raises(OSError):
        kiln.save_quantized(quantized_model(), str(tmp_path / "new.safetensors"))
    assert os.listdir(tmp_path) == []
    name = os.path.basename(written[0])  # what a crash (no cleanup at all) would have left: hidden, not a model
    assert name.startswith(".new.safetensors" + TEMP_INFIX) and not name.endswith(".safetensors")


def test_a_failed_replace_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    kiln.save_quantized(quantized_model(), str(path))
    before = path.read_bytes()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", dst)
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        kiln.save_quantized(kiln.quantize(float_model(), "fp8_e4m3", policy=ALL), str(path))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["model.safetensors"]


def test_a_save_over_an_existing_file_replaces_it_whole(tmp_path):
    path = tmp_path / "model.safetensors"
    kiln.save_quantized(quantized_model(), str(path))
    kiln.save_quantized(kiln.quantize(float_model(), "fp8_e4m3", policy=ALL), str(path))
    assert os.listdir(tmp_path) == ["model.safetensors"]
    loaded = kiln.load_quantized(float_model(), str(path))
    assert {layer.scheme_name for layer in quantized_layers(loaded).values()} == {"fp8_e4m3"}
