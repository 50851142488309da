"""Kiln's compiler: a TorchDynamo backend with named FX rewrite passes. Knows nothing of ComfyUI."""
from .api import KilnUnavailable, compile, stats
from .options import MODE_HELP, MODES, CompileOptions, OptionsError, build_options, parse_expert_options
from .passes import PASS_NAMES
from .stats import GraphCompile, KilnStats

__all__ = ["compile", "stats", "CompileOptions", "OptionsError", "KilnUnavailable", "KilnStats", "GraphCompile",
           "build_options", "parse_expert_options", "MODES", "MODE_HELP", "PASS_NAMES"]
