"""A recording's static input buffers: where a replay reads its inputs.

A CUDA graph reads its inputs at the addresses it was recorded with. `StaticInputs` holds one buffer
per tensor of the call (same shape, strides, dtype and device), walked as the recording key walks
them (compiler/graphs/recording_key.py: containers down to MAX_DEPTH, the tensors inside the host's
options), and the call's arguments rebuilt with those buffers in place of the tensors: the
recording is made by calling the model on them. Before each replay `copy_in` copies the call's
tensors into the buffers; a tensor missed there would replay the previous call's values, which the
fidelity guard catches on a recording's first replay on new inputs (compiler/graphs/fidelity_guard.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from ..host_inputs import HostInputs
from .recording_key import MAX_DEPTH, PLAIN_TYPES


class StaticInputs:
    def __init__(self, args: tuple, kwargs: dict, host: HostInputs):
        self.host = host
        self.places: list[str] = []
        self.buffers: list[torch.Tensor] = []

        def buffer(place: str, tensor: torch.Tensor) -> torch.Tensor:
            static = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            static.copy_(tensor)
            self.places.append(place)
            self.buffers.append(static)
            return static

        self.args = tuple(_rebuilt(f"args[{i}]", value, host, MAX_DEPTH, buffer) for i, value in enumerate(args))
        self.kwargs = {name: _rebuilt(f"kwargs[{name!r}]", kwargs[name], host, MAX_DEPTH, buffer)
                       for name in sorted(kwargs)}

    @property
    def nbytes(self) -> int:
        return sum(buffer.untyped_storage().nbytes() for buffer in self.buffers)

    def copy_in(self, args: tuple, kwargs: dict, skip: frozenset = frozenset()) -> None:
        """Copy the call's tensors into the buffers (the call has this recording's key, so they match
        one to one). `skip`: places not copied, for planting a missed copy in tests only."""
        tensors = list(call_tensors(args, kwargs, self.host))
        if len(tensors) != len(self.buffers):
            raise ValueError(f"the call has {len(tensors)} tensors, the recording {len(self.buffers)}: "
                             "its key should have told them apart")
        for (place, tensor), static in zip(tensors, self.buffers):
            if place not in skip and tensor is not static:
                static.copy_(tensor)


def call_tensors(args: tuple, kwargs: dict, host: HostInputs) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a call with its place, in the order StaticInputs holds their buffers."""
    found: list = []

    def note(place: str, tensor: torch.Tensor) -> torch.Tensor:
        found.append((place, tensor))
        return tensor

    for index, value in enumerate(args):
        _rebuilt(f"args[{index}]", value, host, MAX_DEPTH, note)
    for name in sorted(kwargs):
        _rebuilt(f"kwargs[{name!r}]", kwargs[name], host, MAX_DEPTH, note)
    return iter(found)


def _rebuilt(place: str, value: Any, host: HostInputs, depth: int,
             fn: Callable[[str, torch.Tensor], torch.Tensor], hosted: bool = False) -> Any:
    """`value` with fn(place, tensor) in place of each tensor, by recording_key's walk."""
    if isinstance(value, torch.Tensor):
        return fn(place, value)
    if isinstance(value, PLAIN_TYPES):
        return value
    if not hosted and host.call_fingerprint(value) is not None:
        hosted = True
    if depth <= 0:
        return value  # recording_key refused it (plain containers) or the host's fingerprint answers for it
    if isinstance(value, dict):
        rebuilt = {name: _rebuilt(f"{place}[{name!r}]", item, host, depth - 1, fn, hosted)
                   for name, item in value.items()}
        if type(value) is dict:
            return rebuilt
        copy = type(value).__new__(type(value))
        dict.update(copy, rebuilt)
        copy.__dict__.update(getattr(value, "__dict__", {}))
        return copy
    if isinstance(value, (list, tuple)):
        items = [_rebuilt(f"{place}[{index}]", item, host, depth - 1, fn, hosted) for index, item in enumerate(value)]
        if type(value) in (list, tuple):
            return type(value)(items)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


__all__ = ["StaticInputs", "call_tensors"]
