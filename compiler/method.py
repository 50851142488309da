"""Compile one method of a module that is not its forward: a VAE's `decode` or `encode`.

`method_module(vae_model, "decode")` is a small module whose forward is that method, called on
the class (so a compiled function installed on the instance under the method's name, as ComfyUI's
object patches do, never calls itself). It is made once per module and method, and kept in the
module's own `__dict__` (like `model_for`'s memo), so `model_for(method_module(m, "decode"), plan)`
compiles once per plan and the compiled graphs go with the model.
"""
from __future__ import annotations

import torch

_MEMO = "_kiln_methods"  # module.__dict__: {method name: MethodModule}


class MethodModule(torch.nn.Module):
    """`module.<method>(...)` as a module's forward; named after both, e.g. AutoencoderKL.decode."""

    def __init__(self, module: torch.nn.Module, method: str):
        super().__init__()
        if not callable(getattr(type(module), method, None)):
            raise AttributeError(f"{type(module).__name__} has no method {method!r} to compile")
        self.inner = module
        self.method = method
        self.kiln_label = f"{type(module).__name__}.{method}"

    def forward(self, *args, **kwargs):
        return getattr(type(self.inner), self.method)(self.inner, *args, **kwargs)


def method_module(module: torch.nn.Module, method: str) -> MethodModule:
    """The one MethodModule of `module`'s `method`."""
    methods = module.__dict__.setdefault(_MEMO, {})
    if method not in methods:
        methods[method] = MethodModule(module, method)
    return methods[method]


def label_of(module: torch.nn.Module) -> str:
    """What logs and stats call a compiled module: its class, or Class.method for a MethodModule."""
    return getattr(module, "kiln_label", None) or type(module).__name__
