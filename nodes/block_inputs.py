"""ComfyUI's `transformer_options` as Kiln's compiler must read it (the compiler knows no ComfyUI key:
compiler/host_inputs.py). Registered when Kiln's nodes load (nodes/__init__.py).

ComfyUI passes each block its position (`transformer_options["block"] = ("input", 4)`,
`block_index`), which its attention code looks up in the (empty) dict of attention patches, so
TorchDynamo would guard on it and compile a block region again for every position. When no patch the
block itself calls is installed (BLOCK_PATCHES, `patches_replace`; FreeU's patches run between
blocks), the block sees a neutral position instead (POSITION_KEYS), without the keys a block writes
for patches to read (SCRATCH_KEYS), and what else it writes into the dict is copied back. The sampler
passes its whole schedule down (SCHEDULE_KEY): its length is the step count, which must not recompile.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from ..loaded import compiler
from . import graph_inputs

# the keys that say where a block sits, each with the neutral value a block sees when no patch is
# installed; the keys a block writes for patches to read (its input's shape). Without a patch nothing
# reads either.
POSITION_KEYS = {"block": ("", 0), "block_index": 0, "transformer_index": 0}
SCRATCH_KEYS = ("activations_shape",)
# the patches a block itself calls with its position (attention replacements are keyed by it); the
# others (FreeU's output_block_patch, input_block_patch, ...) run in the glue between blocks
BLOCK_PATCHES = ("attn1_patch", "attn2_patch", "attn1_output_patch", "attn2_output_patch", "middle_patch")
# transformer_options["sample_sigmas"]: the sampler's whole sigma schedule ("sample_sigmas size mismatch
# at index 0. expected 5, actual 3" was a recompile on a new step count, before its length was dynamic)
SCHEDULE_KEY = "sample_sigmas"

_HostInputs = compiler.HostInputs if compiler is not None else object


class ComfyBlockInputs(_HostInputs):
    """ComfyUI's transformer_options, read as compiler/host_inputs.py asks."""

    def carries_position(self, value: Any) -> bool:
        return isinstance(value, dict) and "block" in value

    def calls_position_patches(self, value: Any) -> bool:
        patches = value.get("patches") or {}
        return bool(value.get("patches_replace")) or any(patches.get(key) for key in BLOCK_PATCHES)

    def without_position(self, value: dict) -> dict:
        copy = {key: item for key, item in value.items() if key not in SCRATCH_KEYS}
        copy.update(POSITION_KEYS)
        return copy

    def write_back(self, original: dict, copy: dict, given: dict) -> None:
        for key, item in copy.items():
            if key not in POSITION_KEYS and key not in SCRATCH_KEYS and (key not in given or given[key] is not item):
                original[key] = item

    def schedule_in(self, value: Any) -> Optional[torch.Tensor]:
        sigmas = value.get(SCHEDULE_KEY) if isinstance(value, dict) else None
        return sigmas if isinstance(sigmas, torch.Tensor) and sigmas.dim() == 1 else None

    # whole-call CUDA graphs (compiler/graphs): nodes/graph_inputs.py
    def call_fingerprint(self, value: Any) -> Optional[Hashable]:
        return graph_inputs.fingerprint(value)

    def graph_unsafe(self, value: Any) -> tuple[str, ...]:
        return graph_inputs.unsafe_patches(value)

    def weights_note(self, module: torch.nn.Module) -> str:
        return graph_inputs.weights_note(module)


def register() -> None:
    """Have the compiler read block and model arguments as ComfyUI passes them (nothing without the compiler)."""
    if compiler is not None:
        compiler.use_host_inputs(ComfyBlockInputs())
