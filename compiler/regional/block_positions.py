"""What tells identical blocks apart, hidden where nothing reads it (the host's conventions:
compiler/host_inputs.py).

A host may pass each block its position in the model (ComfyUI: `transformer_options["block"]`),
which TorchDynamo would guard on, compiling a region again for every position. When the block calls
no patch with its position, it is given a copy with a neutral position instead, and what it writes
into the copy goes back into the original; with such patches, the real position goes in (a patch may
depend on it), and each position compiles once.
"""
from __future__ import annotations

import contextlib

from ..host_inputs import host_inputs


def carries_position(value) -> bool:
    """`value`, one argument of a block call, says where the block sits (by the host's conventions)."""
    return host_inputs().carries_position(value)


def calls_position_patches(args: tuple, kwargs: dict) -> bool:
    """A block call's arguments hold patches the block calls with its position (a patch may keep state)."""
    host = host_inputs()
    return any(host.carries_position(v) and host.calls_position_patches(v) for v in (*args, *kwargs.values()))


@contextlib.contextmanager
def positions_hidden(args: tuple, kwargs: dict):
    """(args, kwargs) with each argument that carries a position replaced by a copy with a neutral one,
    where the block calls no patch with it; after the call, what the block wrote into each copy goes
    back into its original."""
    host = host_inputs()
    swapped = []

    def hide(value):
        if not host.carries_position(value) or host.calls_position_patches(value):
            return value
        copy = host.without_position(value)
        swapped.append((value, copy, dict(copy)))
        return copy

    yield tuple(hide(a) for a in args), {k: hide(v) for k, v in kwargs.items()}
    for original, copy, given in swapped:
        host.write_back(original, copy, given)
