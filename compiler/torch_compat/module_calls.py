"""nn.Module calls: routing a module's calls elsewhere for one model call, observing them, hooks, views, and tensors in containers.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], value):
    """`value` with `fn` applied to every tensor in it, through the containers torch's pytree knows
    (tuples, lists, dicts, namedtuples, and types registered with it, as diffusers registers its
    outputs); any other value is kept as it is (torch.utils._pytree.tree_map_only; checked: torch 2.5 - 2.14)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, value)


def call_module_body(module: torch.nn.Module, *args, **kwargs):
    """Call `module` with its hooks but past any compiled call installed on it (`Module._call_impl`,
    what `module(...)` runs when no `_compiled_call_impl` is set; checked: torch 2.5 - 2.14), so
    routing the module's calls elsewhere (`calls_routed`) never loops back."""
    return module._call_impl(*args, **kwargs)


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """`module` itself has forward or forward-pre hooks (`Module._forward_hooks` /
    `_forward_pre_hooks`; checked: torch 2.5 - 2.14)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


@contextlib.contextmanager
def calls_routed(routes: Mapping[torch.nn.Module, Callable]):
    """While inside: `module(...)` runs `routes[module](...)` instead, for each module in `routes`.
    It is the hook `nn.Module.compile()` installs (`_compiled_call_impl`, read by
    `Module._wrapped_call_impl`; checked: torch 2.2 - 2.14), set for the duration of one call of the
    model and put back as it was after, so the module stays the same object (ComfyUI dispatches on
    its class) and behaves as before outside Kiln's call. It is written as `nn.Module.__setattr__`
    writes a value that is no parameter, buffer or submodule (`object.__setattr__`), a tenth of its
    cost: every block of the model is routed and put back on every call."""
    before = {module: module.__dict__.get("_compiled_call_impl") for module in routes}
    observed = {module: call for module, call in before.items() if isinstance(call, ObservedCall)}
    inner_before = {module: call.inner for module, call in observed.items()}
    try:
        for module, route in routes.items():
            if module in observed:  # observed (the step cache's probe): the route runs inside the observer
                observed[module].inner = route
            else:
                object.__setattr__(module, "_compiled_call_impl", route)
        yield
    finally:
        for module, previous in before.items():
            if module in observed:
                observed[module].inner = inner_before[module]
            else:
                object.__setattr__(module, "_compiled_call_impl", previous)


class ObservedCall:
    """What `module(...)` runs inside `calls_observed`: `before(args, kwargs)`, the module's own call
    (or the route `calls_routed` installs inside it), then `after(output, what before answered)`,
    whose answer is the call's."""

    def __init__(self, module: torch.nn.Module, before: Callable, after: Callable, inner: Optional[Callable] = None):
        self.module = module
        # never traced (TorchDynamo graph-breaks around them): an observer reads values and may end the
        # call early by raising. Wrapped here, not at import: torch.compiler.disable loads TorchDynamo
        self.before, self.after = torch.compiler.disable(before), torch.compiler.disable(after)
        self.inner = inner  # what ran the module's calls before (a route, nn.Module.compile's); None: its own call

    def __call__(self, *args, **kwargs):
        seen = self.before(args, kwargs)
        out = self.inner(*args, **kwargs) if self.inner is not None else call_module_body(self.module, *args, **kwargs)
        return self.after(out, seen)


@contextlib.contextmanager
def calls_observed(module: torch.nn.Module, before: Callable, after: Callable):
    """While inside: every call of `module` runs `before(args, kwargs)` on its way in and
    `after(output, what before answered)` on its way out, and answers what `after` returns (or raises
    what it raises). Set on the module as `calls_routed`'s routes are (so TorchDynamo, tracing a whole
    model, never sees it) and put back after; a route installed inside this context runs inside it."""
    previous = module.__dict__.get("_compiled_call_impl")
    module._compiled_call_impl = ObservedCall(module, before, after, previous)
    _observing[0] += 1
    try:
        yield
    finally:
        _observing[0] -= 1
        module._compiled_call_impl = previous


_observing = [0]  # calls_observed contexts open now


def observers_active() -> int:
    """How many `calls_observed` contexts are open: Python that runs inside a model call, mid-call
    (a CUDA graph replay of the whole call would skip it)."""
    return _observing[0]


def is_view(tensor: torch.Tensor) -> bool:
    """`tensor` is a view of another tensor (autograd's view tracking: `Tensor._is_view`; checked:
    torch 2.5 - 2.14). Inference-mode tensors are never views."""
    return tensor._is_view()
