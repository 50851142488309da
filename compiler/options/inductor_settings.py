"""The Inductor settings a workflow may change (Compile UNet's `advanced: {inductor: ...}`), and to what.

A workflow is untrusted, and Inductor's config holds far more than tuning: the C++ compiler it runs
(`cpp.cxx`), remote caches it unpickles from (`fx_graph_remote_cache`), directories it writes to
(`trace.debug_dir`, `aot_inductor.output_path`), callables it calls (`post_grad_custom_post_pass`).
So only the tuning settings in TUNING are accepted, each with the values it may take: they change
which kernels Inductor picks and how it fuses them, never what runs, where files go or where code
comes from. Kiln's own choices stay Kiln's: `mode: max` applies torch's max-autotune-no-cudagraphs
preset itself (compiler/backend/lowering.py), and CUDA graphs come from the `cuda_graphs` option.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..torch_compat import inductor
from .option_text import shorten


@dataclass(frozen=True)
class Values:
    """What one setting may be set to: `describe` for the error message, `accepts` to check a value."""

    describe: str
    accepts: Callable[[Any], bool]


FLAG = Values("true or false", lambda value: isinstance(value, bool))


def whole_number(low: int, high: int) -> Values:
    return Values(f"a whole number from {low} to {high}",
                  lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value <= high)


def names_from(*names: str) -> Values:
    """A comma-separated list of names, upper case as Inductor compares them (e.g. "ATEN,TRITON")."""
    return Values(f"a comma-separated list of {', '.join(names)} (e.g. {','.join(names[:2])})",
                  lambda value: isinstance(value, str) and 0 < len(value) <= 64
                  and all(name in names for name in value.split(",")))


# Inductor setting -> the values a workflow may give it. Read in torch/_inductor/config.py (torch 2.13).
TUNING: dict[str, Values] = {
    # autotuning: benchmark candidate kernels and keep the fastest (a longer compile, the same graph)
    "max_autotune": FLAG,
    "max_autotune_gemm": FLAG,
    "max_autotune_pointwise": FLAG,
    # CUTLASS and CK are left out: they build C++ templates with nvcc/hipcc and, without their caps on
    # profiled configs (not allowed here), can profile thousands of kernels
    "max_autotune_gemm_backends": names_from("ATEN", "TRITON", "CPP"),
    "max_autotune_conv_backends": names_from("ATEN", "TRITON"),
    # EXHAUSTIVE is left out for the same reason: Triton then profiles every matmul config it can build
    # (about 1,900 per matmul shape, against about 20 for DEFAULT)
    "max_autotune_gemm_search_space": Values(
        "DEFAULT (EXHAUSTIVE is refused: it makes Triton profile about 1,900 kernels per matmul shape, "
        "against about 20, as CUTLASS and CK would)", lambda value: value == "DEFAULT"),
    "coordinate_descent_tuning": FLAG,
    "coordinate_descent_check_all_directions": FLAG,
    "coordinate_descent_search_radius": whole_number(1, 8),
    "triton.autotune_cublasLt": FLAG,
    "benchmark_fusion": FLAG,
    "benchmark_epilogue_fusion": FLAG,
    # fusion
    "epilogue_fusion": FLAG,
    "epilogue_fusion_first": FLAG,
    "prologue_fusion": FLAG,
    "aggressive_fusion": FLAG,
    "max_fusion_size": whole_number(1, 512),
    "pattern_matcher": FLAG,  # Inductor's own patterns; Kiln's passes run before Inductor either way
    "loop_ordering_after_fusion": FLAG,
    "reorder_for_locality": FLAG,
    # reductions, tiling, layout and padding
    "split_reductions": FLAG,
    "triton.persistent_reductions": FLAG,
    "triton.cooperative_reductions": FLAG,
    "triton.prefer_nd_tiling": FLAG,
    "layout_optimization": FLAG,
    "conv_1x1_as_mm": FLAG,
    "shape_padding": FLAG,
    "comprehensive_padding": FLAG,
}

# Settings Kiln sets itself from an option of its own: the error says which option to use.
KILN_OWNED = {
    "triton.cudagraphs": "use the cuda_graphs option (Kiln turns it on per device and bounds the recordings "
                         "with shapes.max_cuda_graphs)",
    "triton.cudagraph_trees": "use the cuda_graphs option (Kiln's bound on recordings needs CUDA graph trees)",
    "fx_graph_cache": "use Kiln's cache (cache: {dir: ..., mode: use})",
}


def allowed_names() -> list[str]:
    """The settings in TUNING that this torch has."""
    return [name for name in TUNING if inductor.is_inductor_option(name)]


def setting_problem(name: Any, value: Any) -> Optional[str]:
    """Why a workflow may not set Inductor setting `name` to `value` (a message naming the key), or None."""
    if isinstance(name, str) and name in KILN_OWNED:
        return f"inductor.{name}: Kiln sets this itself; {KILN_OWNED[name]}"
    if not isinstance(name, str) or not inductor.is_inductor_option(name):
        return (f"inductor: {shorten(name)} is not an Inductor config setting (nested settings are dotted, e.g. "
                f"'triton.persistent_reductions'); the tuning settings Kiln accepts: {', '.join(allowed_names())}")
    if name not in TUNING:
        return (f"inductor.{name}: a workflow may change only Inductor's tuning settings, never programs, paths, "
                f"caches, hooks or debug output; allowed: {', '.join(allowed_names())}")
    if not TUNING[name].accepts(value):
        return f"inductor.{name}={shorten(value)}: use {TUNING[name].describe}"
    return None
