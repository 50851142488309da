"""What a host application passes a model and its blocks, as far as the compiler must know it.

The compiler knows no host's keys. A host that passes its blocks more than tensors (ComfyUI gives
each block a `transformer_options` dict that says where the block sits and which patches it calls;
nodes/block_inputs.py) describes that with a `HostInputs` and registers it (`use_host_inputs`). The
compiler asks it three things:

- where a block's argument says where the block sits (`carries_position`), so that identical blocks
  can share one compiled code: the block is given a copy with a neutral position
  (`without_position`), and what it writes into that copy goes back into the original
  (`write_back`), unless the argument also holds patches the block calls with its position
  (`calls_position_patches`: a patch may depend on the position, or keep state);
- which tensor in a model's argument is a sampler's schedule (`schedule_in`), whose length is the
  step count and must stay dynamic;
- for replaying a whole model call as a CUDA graph (compiler/graphs): what of a model's argument a
  recording bakes in beyond its tensors (`call_fingerprint`: the patches and their ids, which half of
  a guidance batch is which, ...), which of the patches and wrappers it holds are not graph-safe
  (`graph_unsafe`: a patch with Python state or a host sync), and why a model's weights cannot be
  read at fixed addresses (`weights_note`: streamed or patched per call).

The default answers "nothing": a plain PyTorch model's blocks get only tensors.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import torch


class HostInputs:
    """A host's conventions for what it passes a model and its blocks. This base class is the plain
    PyTorch caller's: no argument carries a position, no schedule is passed."""

    def carries_position(self, value: Any) -> bool:
        """`value` (one argument of a block call) says where the block sits in the model."""
        return False

    def calls_position_patches(self, value: Any) -> bool:
        """`value` (an argument that carries a position) holds patches the block calls with its position."""
        return False

    def without_position(self, value: dict) -> dict:
        """A copy of `value` in which every block of a region sees the same position."""
        return value

    def write_back(self, original: dict, copy: dict, given: dict) -> None:
        """After the call: what the block wrote into `copy` (made from `original`, given to the block
        as `given`) that belongs in `original`."""

    def schedule_in(self, value: Any) -> Optional[torch.Tensor]:
        """A sampler's whole schedule inside `value` (one argument of a model call), if it holds one."""
        return None

    def call_fingerprint(self, value: Any) -> Optional[Hashable]:
        """For an argument of a model call that is the host's options (not a plain tensor or
        container): a hashable summary of every Python value in it that the call reads, which a CUDA
        graph recording bakes in (compiler/graphs/recording_key.py keys the tensors inside it itself).
        None: `value` is not the host's; Kiln keys it by its own rules."""
        return None

    def graph_unsafe(self, value: Any) -> tuple[str, ...]:
        """The patches, replacements and wrappers in `value` (one argument of a model call) that are
        not on the host's graph-safe list, by name: a recording would replay them without their Python
        (state kept between calls, `.item()`, a decision made mid-call)."""
        return ()

    def weights_note(self, module: torch.nn.Module) -> str:
        """Why `module`'s weights cannot be read at the addresses a recording bakes in (the host
        streams them or patches them per call), or ""."""
        return ""


_host = HostInputs()


def use_host_inputs(host: HostInputs) -> None:
    """From now on the compiler reads block and model arguments by `host`'s conventions (a process runs
    in one host: the last registered wins)."""
    global _host
    _host = host


def host_inputs() -> HostInputs:
    return _host
