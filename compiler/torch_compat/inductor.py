"""Inductor: its compile, scoped config, cache key tag, cache directories and counters, its probe of the CPU.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations

import contextlib
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping


def inductor_compile_fx() -> Callable:
    """Inductor's graph compiler itself (`torch._inductor.compile_fx.compile_fx`), as a backend: what
    the registered "inductor" backend calls after it first starts the worker processes that compile
    Triton kernels when Triton is installed (checked: torch 2.5 - 2.14)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """Inductor config that `torch.compile(mode=...)` would set, e.g. for "max-autotune-no-cudagraphs"."""
    import torch._inductor

    return dict(torch._inductor.list_mode_options(mode))


def inductor_config_patch(changes: Mapping[str, Any]):
    """Scoped Inductor config: applies only inside the `with` block, never globally."""
    if not changes:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(dict(changes))


def cache_key_tag(tag: str):
    """Scoped `torch.compiler.config.cache_key_tag`: Inductor's FX graph cache key includes it (checked:
    torch 2.6 - 2.13). A no-op where torch lacks it or `tag` is empty."""
    import torch.compiler.config as compiler_config

    if not tag or not hasattr(compiler_config, "cache_key_tag"):
        return contextlib.nullcontext()
    return compiler_config.patch(cache_key_tag=tag)


def inductor_cache_hits() -> int:
    """How many graphs Inductor has loaded from its on-disk FX graph cache in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


def is_inductor_option(name: str) -> bool:
    """True if `name` (dotted for nested, e.g. "triton.cudagraphs") is an Inductor config setting."""
    import torch._inductor.config as inductor_config

    return name in inductor_config.get_config_copy()


def inductor_cache_dir(path: str):
    """Inductor (FX graph, AOTAutograd and kernel caches) reads and writes under `path` inside the
    `with` block only; its in-memory caches are cleared on entry and exit, so every kernel a
    lowering needs is written there (checked: torch 2.6 - 2.13)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(path)


def inductor_persistent_caches():
    """Scoped: Inductor's FX graph cache and AOTAutograd's cache on, whatever the process set."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch({"fx_graph_cache": True}))
    stack.enter_context(functorch_config.patch({"enable_autograd_cache": True}))
    return stack


def inductor_cache_counts() -> dict[str, int]:
    """Inductor's and AOTAutograd's cache counters: {"fxgraph_cache_hit": n, "fxgraph_cache_miss": n, ...}."""
    from torch._dynamo.utils import counters

    names = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    out = {name: int(counters["inductor"][name]) for name in names}
    out.update({name: int(counters["aot_autograd"][name])
                for name in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")})
    return out


def fresh_inductor_cache():
    """A context in which Inductor compiles into an empty cache (a temporary directory, its in-memory
    caches cleared), as on a machine that never compiled: for timing a cold compile next to
    others in one process (`torch._inductor.utils.fresh_inductor_cache`; checked: torch 2.5 - 2.14)."""
    from torch._inductor.utils import fresh_inductor_cache as fresh

    return fresh()


def detect_cpu_vector_isa(in_parallel: bool = False) -> None:
    """Let Inductor probe the CPU's vector instruction sets now, as its first CPU lowering would. It
    builds a test program per instruction set the CPU reports into its current cache directory,
    skipping any already built there, loads each in a child process, and keeps the answer for the
    process (`torch._inductor.cpu_vec_isa.valid_vec_isa_list`, cached; checked: torch 2.5 - 2.14).
    Inductor checks the sets one after another; `in_parallel` checks each set the CPU reports in a
    thread of its own first (each set keeps its answer on itself, `bool(isa)`, cached;
    `supported_vec_isa_list`, `x86_isa_checker`: checked as above), and Inductor's list is then made
    of those answers."""
    from torch._inductor import cpu_vec_isa

    if in_parallel and sys.platform in ("linux", "win32") and platform.machine() in ("x86_64", "AMD64"):
        reported = cpu_vec_isa.x86_isa_checker()
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in reported for flag in str(isa).split())]
        if len(candidates) > 1:
            with ThreadPoolExecutor(len(candidates), thread_name_prefix="kiln-cpu-probe") as pool:
                list(pool.map(bool, candidates))
    cpu_vec_isa.valid_vec_isa_list()


def cpu_vector_isa_detected() -> bool:
    """Whether Inductor has probed the CPU in this process (its answer is cached: checked as above)."""
    from torch._inductor import cpu_vec_isa

    info = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    return info is not None and info().currsize > 0
