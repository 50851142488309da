"""What a recording of a whole model call assumes: its `RecordingKey`.

A replay runs no Python and checks no guard: it reads its inputs from the static buffers the
recording was made with, and its weights at the addresses it saw. Everything a recording bakes in
is therefore in its key, and a call whose key differs is never replayed on that recording:

- every tensor argument, at any depth up to MAX_DEPTH (a host's options dict and a ControlNet's
  residual lists included): its place in the call, shape, strides, dtype and device (`TensorSpec`);
- every Python value the call is given (a scale, a flag, a schedule index), by its place: a
  recording bakes the number it saw, which must never go stale;
- for an argument that is the host's options (compiler/host_inputs.py `call_fingerprint`): the
  host's fingerprint of it (its patches and their ids, which half of a guidance batch is which, ...),
  since only the host knows which of its values the call reads;
- grad, inference and autocast modes (`CallModes`);
- the address of every parameter and buffer of the model (`weights`): a LoRA, a model swap or a
  host re-patching weights installs new tensors, and a recording must be made again (re-captured,
  never recompiled: the compiled code reads whatever weights it is given).

Tensors inside the host's options are keyed (and copied into static buffers:
compiler/graphs/static_inputs.py, by the same walk) down to MAX_DEPTH containers; the host's
fingerprint answers for anything deeper. `RecordingKey.shape` is the key without the weights: the place a recording holds in the budget,
re-captured in place when only the weights moved. An argument the key cannot describe (an object
that is neither a tensor, a plain value, a container nor the host's) raises `Unkeyable`, naming it:
that call runs without graphs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Optional

import torch

from ..host_inputs import HostInputs

MAX_DEPTH = 4          # containers inside containers: a ControlNet's {"input": [tensor, ...]} is 2 deep
MAX_KEYED_VALUES = 4096  # tensors and plain values in one call; a call with more is not recorded
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class Unkeyable(ValueError):
    """A call's argument that a recording key cannot describe; the message names it."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument as a recording's static buffer holds it."""

    place: str                  # "args[0]", "kwargs['context']", "kwargs['control']['input'][3]"
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, place: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(place, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, str(tensor.device))


@dataclass(frozen=True)
class CallModes:
    """The autograd and autocast modes a call runs under: a recording replays the kernels of its own."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype) for cuda and cpu

    @classmethod
    def now(cls) -> "CallModes":
        autocast = tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in ("cuda", "cpu"))
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


@dataclass(frozen=True)
class RecordingKey:
    tensors: tuple[TensorSpec, ...]
    values: tuple[tuple[str, Hashable], ...]   # (place, plain Python value)
    host: tuple[tuple[str, Hashable], ...]     # (place, the host's fingerprint of its options there)
    modes: CallModes
    weights: tuple[int, ...]                    # data_ptr of every parameter and buffer, in module order

    @property
    def shape(self) -> "RecordingKey":
        """The key without the weights' addresses: the recording's place, re-captured when only they change."""
        return dataclasses.replace(self, weights=())

    def line(self) -> str:
        sizes = ", ".join("x".join(map(str, spec.shape)) for spec in self.tensors[:4])
        more = f" (+{len(self.tensors) - 4} tensors)" if len(self.tensors) > 4 else ""
        return f"{sizes}{more}"


def weight_addresses(module: torch.nn.Module) -> tuple[int, ...]:
    """Where `module`'s parameters and buffers live now, in module order."""
    return tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers()))


def recording_key(module: torch.nn.Module, args: tuple, kwargs: dict, host: HostInputs,
                  weights: Optional[tuple[int, ...]] = None) -> RecordingKey:
    """The key of one call of `module` (see the module docstring; `weights`: its weight_addresses, if the
    caller has them already); Unkeyable names what it cannot describe."""
    tensors, values, hosted = [], [], []
    for place, value in _leaves(args, kwargs, host):
        if isinstance(value, torch.Tensor):
            tensors.append(TensorSpec.of(place, value))
        elif isinstance(value, _Hosted):
            hosted.append((place, value.fingerprint))
        else:
            values.append((place, value))
        if len(tensors) + len(values) > MAX_KEYED_VALUES:
            raise Unkeyable(f"the call has more than {MAX_KEYED_VALUES} tensors and values (MAX_KEYED_VALUES)")
    return RecordingKey(tuple(tensors), tuple(values), tuple(hosted), CallModes.now(),
                        weight_addresses(module) if weights is None else weights)


@dataclass(frozen=True)
class _Hosted:
    fingerprint: Hashable


def _leaves(args: tuple, kwargs: dict, host: HostInputs) -> Iterator[tuple[str, Any]]:
    for index, value in enumerate(args):
        yield from _walk(f"args[{index}]", value, host, MAX_DEPTH)
    for name in sorted(kwargs):
        yield from _walk(f"kwargs[{name!r}]", kwargs[name], host, MAX_DEPTH)


def _walk(place: str, value: Any, host: HostInputs, depth: int) -> Iterator[tuple[str, Any]]:
    if isinstance(value, torch.Tensor):
        yield place, value
        return
    if isinstance(value, PLAIN_TYPES):
        yield place, value
        return
    fingerprint = _fingerprint(place, value, host)
    if fingerprint is not None:  # the host's options: its fingerprint, and the tensors inside
        yield place, _Hosted(fingerprint)
        yield from _tensors_only(place, value, depth)
        return
    if depth <= 0:
        raise Unkeyable(f"{place} nests containers deeper than {MAX_DEPTH} (MAX_DEPTH)")
    if isinstance(value, dict):
        yield place, ("dict", tuple(_plain_key(place, k) for k in value))
        for name, item in value.items():
            yield from _walk(f"{place}[{name!r}]", item, host, depth - 1)
    elif isinstance(value, (list, tuple)):
        yield place, (type(value).__name__, len(value))
        for index, item in enumerate(value):
            yield from _walk(f"{place}[{index}]", item, host, depth - 1)
    else:
        raise Unkeyable(f"{place} is a {type(value).__name__}, which a recording cannot key (not a tensor, a plain "
                        "value, a list, tuple or dict, nor options the host fingerprints)")


def _fingerprint(place: str, value: Any, host: HostInputs) -> Optional[Hashable]:
    fingerprint = host.call_fingerprint(value)
    if fingerprint is not None:
        try:
            hash(fingerprint)
        except TypeError:
            raise Unkeyable(f"{place}: the host's fingerprint of it is not hashable ({type(fingerprint).__name__})") from None
    return fingerprint


def _tensors_only(place: str, value: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield place, value
    elif depth > 0 and isinstance(value, dict):
        for name, item in value.items():
            yield from _tensors_only(f"{place}[{name!r}]", item, depth - 1)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_only(f"{place}[{index}]", item, depth - 1)


def _plain_key(place: str, key: Any) -> Hashable:
    if not isinstance(key, PLAIN_TYPES):
        raise Unkeyable(f"{place} has a key of type {type(key).__name__}")
    return key


__all__ = ["RecordingKey", "TensorSpec", "CallModes", "Unkeyable", "recording_key", "weight_addresses",
           "MAX_DEPTH", "MAX_KEYED_VALUES"]
