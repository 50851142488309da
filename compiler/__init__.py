"""Kiln's compiler: a TorchDynamo backend with named FX rewrite passes. Knows nothing of ComfyUI."""
from .api import compile, stats, wait_lowered
from .cache import (CACHE_MODES, CacheEntryError, CacheError, CacheLocationError, CacheOptions, CacheOptionsError,
                    CacheStore, CacheTrustError, cache_problem, default_cache_dir, describe_cache, server_cache_dir)
from .host_inputs import HostInputs, host_inputs, use_host_inputs
from .host_layers import HostLayers, host_layers, use_host_layers
from .memory_budget import BlockWeights, DeviceMemory, MemoryVerdict, memory_verdict
from .method import MethodModule, label_of, method_module
from .options.modes import LOWERINGS, MODES, Lowering
from .model import KilnModel, KilnUnavailable, kernel_note, model_for, unavailable_reason
from .options.compile_options import CompileOptions, OptionsError, parse_expert_options
from .passes import PASS_NAMES
from .plan import KilnPlan, build_options
from .quantize import (SCHEMES, LayerPolicy, QuantizeError, QuantizeOptions, QuantReport, parse_policy, quant_report,
                       quantize)
from .quantize import load as load_quantized
from .quantize import READER_COMFYUI, READER_KILN, marked_formats, pop_quantized_layer, reader_for, stored_to_layer
from .quantize import readers as quantized_file_readers
from .quantize import save as save_quantized
from .options.shape_policy import ShapePolicyError
from .stats import GraphCompile, KilnStats
from .step_cache.first_block_probe import first_block_of, first_block_probed
from .step_cache.decision import StepCache, StepCacheError, StepCacheOptions, StepCacheReport
from .step_cache.step_cached_model import StepCachedModel, step_cached
from ..kernels.quant import tensorwise_fp8_linear  # a host's per-tensor fp8 Linear, traceable (compiler/host_layers.py)

__all__ = ["compile", "stats", "wait_lowered", "HostInputs", "host_inputs", "use_host_inputs", "HostLayers", "host_layers",
           "use_host_layers", "first_block_of", "first_block_probed", "StepCache", "StepCacheError", "StepCacheOptions",
           "StepCacheReport", "StepCachedModel", "step_cached", "CompileOptions", "OptionsError", "ShapePolicyError", "KilnUnavailable", "KilnStats",
           "GraphCompile", "KilnModel", "MethodModule", "method_module", "label_of", "KilnPlan", "model_for", "unavailable_reason", "kernel_note",
           "build_options", "parse_expert_options", "MODES", "LOWERINGS", "Lowering", "PASS_NAMES",
           "quantize", "quant_report", "QuantizeOptions", "QuantReport", "LayerPolicy", "parse_policy", "QuantizeError",
           "SCHEMES", "save_quantized", "load_quantized", "pop_quantized_layer", "stored_to_layer",
           "marked_formats", "reader_for", "READER_KILN", "READER_COMFYUI", "quantized_file_readers",
           "CacheOptions", "CacheOptionsError", "CACHE_MODES", "CacheStore", "CacheTrustError",
           "CacheEntryError", "CacheError", "CacheLocationError", "cache_problem", "default_cache_dir",
           "server_cache_dir", "describe_cache", "tensorwise_fp8_linear",
           "BlockWeights", "DeviceMemory", "MemoryVerdict", "memory_verdict"]
