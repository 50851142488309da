"""TorchDynamo: backends by name, guard failures and graph breaks, dynamic sizes, recompile limits, per-code entries and its config scopes.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Mapping

import torch


def lookup_backend(name: str) -> Callable:
    """A registered TorchDynamo backend by name ("inductor", "cudagraphs", ...)."""
    return torch._dynamo.lookup_backend(name)


def forget_code(code) -> None:
    """Drop TorchDynamo's record of guard failures for a code object nothing else will run again
    (a dead model's entry function): that record holds the code object, and with it every cache
    entry TorchDynamo keeps on the code: the model's compiled graphs."""
    from torch._dynamo.utils import guard_failures as failures

    failures.pop(code, None)


def guard_failure_counts() -> dict:
    """{code object: how many guard failures (recompile reasons) TorchDynamo has recorded for it}.
    Cheap enough for every call: nothing is formatted."""
    from torch._dynamo.utils import guard_failures as failures

    return {code: len(reasons) for code, reasons in list(failures.items())}  # a copy: another thread may compile


def guard_failures_since(counts: dict) -> list[str]:
    """The guard failures recorded after `counts` was taken, on any code object, in the order recorded
    per code: a recompile records one per cached graph that failed, the newest graph first.
    TorchDynamo files them under the frame it compiles: the model's forward, or a wrapper frame of
    its own when that forward is torch.nn's (an nn.Sequential compiled as a whole)."""
    from torch._dynamo.utils import guard_failures as failures

    return [str(reason) for code, reasons in failures.items() for reason in reasons[counts.get(code, 0):]]


def graph_break_count() -> int:
    """How many graph breaks TorchDynamo has recorded in this process (`graph_break_reasons`, appended
    as each break is hit, cleared by torch._dynamo.reset(); checked: torch 2.5 - 2.14)."""
    from torch._dynamo.utils import graph_break_reasons

    return len(graph_break_reasons)


def graph_breaks_since(count: int) -> list[str]:
    """The graph breaks recorded after `graph_break_count()` returned `count`, oldest first, each as
    'where: what' with the innermost user frame, e.g. 'nodes_ipadapter.py:133 in __call__: Unsupported
    Tensor.item() call with capture_scalar_outputs=False'."""
    from torch._dynamo.utils import graph_break_reasons

    new = graph_break_reasons[count:] if count <= len(graph_break_reasons) else graph_break_reasons  # after a reset
    return [_describe_graph_break(reason) for reason in new]


def _describe_graph_break(reason) -> str:
    lines = str(reason.reason).strip().splitlines()
    what = lines[0] if lines else "unknown reason"
    if not reason.user_stack:
        return what
    frame = reason.user_stack[-1]
    path = "/".join(str(frame.filename).replace("\\", "/").split("/")[-3:])
    return f"{path}:{frame.lineno} in {frame.name}: {what}"


def compile_failure_types() -> tuple[type, ...]:
    """Exceptions that mean "compiling failed" (as opposed to the model itself failing)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return (BackendCompilerFailed,)


def failed_while_capturing(exc: BaseException) -> bool:
    """True if `exc` is TorchDynamo's own error (one of its exceptions, or an AssertionError) raised while it was
    capturing a frame (its convert_frame.py is on the traceback), not by compiled or eager code running: its errors
    on inputs it cannot wrap (e.g. a tensor subclass whose metadata holds a symbolic torch.Size, ComfyUI 0.33's fp8
    activations on torch 2.14) come as a plain AssertionError from there (checked: torch 2.13, 2.14). Anything else
    raised there (a host's cancel) is not a failed compile."""
    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(exc, (AssertionError, TorchDynamoException)):
        return False
    traceback = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename.endswith(_CONVERT_FRAME):
            return True
        traceback = traceback.tb_next
    return False


_CONVERT_FRAME = os.path.join("torch", "_dynamo", "convert_frame.py")


def allow_any_size(tensor, dim: int = 0) -> None:
    """Tell TorchDynamo not to specialise on this tensor's size along `dim` (no recompile when it changes)."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def allow_any_sizes(tensor) -> None:
    """`allow_any_size` along every dimension (TorchDynamo still specialises a size of 0 or 1, and a
    size that the code fixes, e.g. one a weight must match). Called on every input of every block
    call, so a plain tensor gets the record `maybe_mark_dynamic` writes (`_dynamo_weak_dynamic_indices`;
    checked: torch 2.5 - 2.14) in one step: about 1 us instead of its ~8 us of per-dimension calls."""
    if not tensor.dim():
        return
    if type(tensor) is torch.Tensor:
        tensor._dynamo_weak_dynamic_indices = set(range(tensor.dim()))
    else:  # a tensor subclass: maybe_mark_dynamic also marks the tensors inside it
        torch._dynamo.maybe_mark_dynamic(tensor, list(range(tensor.dim())))


def describe_compile_failure(exc: BaseException) -> str:
    """One line naming what actually failed inside TorchDynamo's BackendCompilerFailed wrapper."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return f"{type(inner).__name__}: {first}"[:500]


def recompile_limit() -> int:
    """TorchDynamo's limit on compiled variants per code object (`recompile_limit`, formerly `cache_size_limit`)."""
    import torch._dynamo.config as dynamo_config

    return int(getattr(dynamo_config, "recompile_limit", getattr(dynamo_config, "cache_size_limit", 8)))


def recompile_limit_at_least(limit: int):
    """A context in which TorchDynamo's per-code recompile limit is at least `limit` (scoped
    `config.patch`, read when a frame compiles; checked: torch 2.5 - 2.14)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    if recompile_limit() >= limit:
        return contextlib.nullcontext()
    return ConfigScope(dynamo_config, {name: limit})


def own_code(function, name: str):
    """A copy of `function` with a code object of its own, named `name`. TorchDynamo keeps compiled
    graphs and counts its recompile limit per code object (checked: torch 2.5 - 2.14): compiling a copy
    gives each model (and each block region) graphs and a budget of its own, freed with it, and where a
    graph breaks inside it TorchDynamo resumes in this code, not in code every caller shares."""
    code = function.__code__.replace(co_name=name)
    return type(function)(code, function.__globals__, name)


def no_duck_sizing():
    """A context in which TorchDynamo gives two equal sizes two symbols rather than one (duck sizing
    off: `torch.fx.experimental._config.use_duck_shape`; checked: torch 2.5 - 2.14). A block first
    called with a square latent must not assume height == width."""
    import torch.fx.experimental._config as fx_config

    return ConfigScope(fx_config, {"use_duck_shape": False})


def no_fake_dispatch_cache(symbolic_sizes: bool = True):
    """A context in which a capture starting inside it gives its fake tensors no dispatch cache, where
    its sizes are symbolic (`symbolic_sizes`: Kiln marks them dynamic, or `dynamic=True`); else none
    (`torch._dynamo.config.fake_tensor_cache_enabled`, read when TorchDynamo makes a frame's fake
    modes; checked: torch 2.13, 2.14; older releases have the setting too, and one without it is
    left as is). The rule: with symbolic sizes a key hashes sympy expressions and a block's trace
    rarely repeats an op, so the cache costs more than it saves; with static sizes it pays
    (docs/measurements/2026-11-27-cpu-fake-dispatch-cache.md)."""
    import torch._dynamo.config as dynamo_config

    if not symbolic_sizes or not hasattr(dynamo_config, "fake_tensor_cache_enabled"):
        return contextlib.nullcontext()
    return ConfigScope(dynamo_config, {"fake_tensor_cache_enabled": False})


def settings_per_thread() -> bool:
    """torch keeps a setting set in one thread (`torch._dynamo.config.x = ...`, a ConfigScope) to that
    thread and the threads run in a copy of its context: each config entry's value is a ContextVar
    (`_ConfigEntry.user_override`; checked: torch 2.13, 2.14). Older releases keep one value for the
    process, which a thread's ConfigScope would change under another thread's capture."""
    import contextvars

    import torch.fx.experimental._config as fx_config

    entry = getattr(fx_config, "_config", {}).get("use_duck_shape")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


class ConfigScope:
    """Inside `with`: each of `values` set on `config` (a torch config module), and put back after,
    as `config.patch(values)` does (checked: torch 2.5 - 2.14) at a third of its cost or less: `patch`
    builds a class on every call, and a model compiled by blocks enters three of these per call."""

    __slots__ = ("config", "values", "before")

    def __init__(self, config, values: Mapping[str, object]):
        self.config, self.values, self.before = config, values, None

    def __enter__(self) -> None:
        self.before = {name: getattr(self.config, name) for name in self.values}
        for name, value in self.values.items():
            setattr(self.config, name, value)

    def __exit__(self, *exc) -> None:
        for name, value in self.before.items():
            setattr(self.config, name, value)
