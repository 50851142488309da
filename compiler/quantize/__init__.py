"""Kiln's quantization: int8 and fp8 weights for diffusion models, chosen layer by layer.

    quantize(module, scheme, policy)   a quantized copy (the original is untouched), with a report
    save(module, path) / load(module, path)   safetensors in ComfyUI's per-layer layout (file_format.py)
    marked_formats(state_dict) / reader_for(...)   which formats a file has, and who reads it

Schemes are in scheme.py, the layer policy in policy.py (its GPU speed rule in speed_rule.py), calibration in calibrate.py; the
quantized layers (layers.py) run the kiln:: GEMM ops of kernels/quant/.
"""
from .file_format import (FORMAT_KEYS, READER_COMFYUI, READER_KILN, MarkedFormat, StoredLayer, install, load,
                          marked_formats, pop_quantized_layer, quantized_state_dict, reader_for, readers, save,
                          split_quantized, stored_to_layer)
from .layers import QUANT_LAYERS, QuantConv2d, QuantLinear, quantized_layers
from .policy import FAMILY_KEEP, LayerPolicy, detect_family, parse_policy
from .quantize import QuantizeOptions, quant_report, quantize
from .report import QuantReport
from .scheme import SCHEMES, QuantizeError, Scheme, scheme_named
from .speed_rule import SPEED_RULES, GemmSpeedRule, gpu_class, rows_at_reference, rule_for

__all__ = ["quantize", "QuantizeOptions", "quant_report", "save", "load", "QuantReport", "LayerPolicy", "parse_policy", "detect_family",
           "FAMILY_KEEP", "SCHEMES", "Scheme", "scheme_named", "QuantizeError", "QuantLinear", "QuantConv2d",
           "QUANT_LAYERS", "quantized_layers", "StoredLayer", "pop_quantized_layer", "split_quantized", "install",
           "stored_to_layer", "quantized_state_dict", "FORMAT_KEYS", "MarkedFormat", "marked_formats", "reader_for",
           "readers", "READER_KILN", "READER_COMFYUI", "GemmSpeedRule", "SPEED_RULES", "gpu_class", "rule_for",
           "rows_at_reference"]
