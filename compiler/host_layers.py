"""A host's layers that TorchDynamo cannot trace, and the traceable forward that stands in for each.

The compiler knows no host's layer classes. A host whose layers compute with something TorchDynamo
cannot capture (ComfyUI 0.33's fp8 Linear layers wrap their activations in a tensor subclass made inside
the layer, with symbolic sizes in its metadata) describes them with a `HostLayers` and registers it
(`use_host_layers`; ComfyUI's is nodes/comfy_layers.py). The compiler asks it one thing:

- `traceable_forward(layer)`: a function `(layer, *args, **kwargs) -> output` that computes what the
  layer's forward computes, from plain tensors, or None for a layer that needs none. The function may
  defer to the layer's own forward where it does not apply (a weight patch the host must apply itself):
  that choice is a branch TorchDynamo traces and guards on.

While a compiled call runs (a region's blocks, or a model compiled whole), `stand_ins(module)` sets
each such layer's forward to its stand-in (an instance attribute, which `Module._call_impl` reads
first) and removes it after, so outside Kiln's call the layer is the host's own, unchanged. A layer
that already has an instance forward (someone else's) is left alone. The stand-ins of a module are
found once (the module's layers are the host's: it does not swap them) and bound once, so TorchDynamo
sees the same function on every call and does not recompile.

The default answers None: a plain PyTorch model has no such layers.
"""
from __future__ import annotations

import contextlib
import threading
import types
import weakref
from typing import Callable, Iterator, Optional

import torch


class HostLayers:
    """A host's layers that need a traceable forward. This base class has none."""

    def traceable_forward(self, layer: torch.nn.Module) -> Optional[Callable]:
        """A function of (layer, *args, **kwargs) computing `layer`'s output in traceable ops, or None."""
        return None


_host = HostLayers()
_found: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def use_host_layers(host: HostLayers) -> None:
    """From now on the compiler asks `host` which layers need a traceable forward (the last registered wins)."""
    global _host
    _host = host
    with _lock:
        _found.clear()


def host_layers() -> HostLayers:
    return _host


def _stand_ins_of(module: torch.nn.Module) -> tuple:
    """((layer, bound stand-in), ...) for `module` and every layer under it, found and bound once."""
    with _lock:
        found = _found.get(module)
        if found is None:
            found = tuple((layer, types.MethodType(fn, layer)) for layer in module.modules()
                          if (fn := _host.traceable_forward(layer)) is not None)
            _found[module] = found
        return found


@contextlib.contextmanager
def stand_ins(module: torch.nn.Module) -> Iterator[int]:
    """While inside, each layer of `module` the host names runs its traceable stand-in; yields how many."""
    installed = []
    for layer, forward in _stand_ins_of(module):
        if "forward" not in layer.__dict__:
            layer.__dict__["forward"] = forward
            installed.append(layer)
    try:
        yield len(installed)
    finally:
        for layer in installed:
            layer.__dict__.pop("forward", None)
