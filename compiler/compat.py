"""Every private or version-dependent torch API Kiln touches, in one place.

If a torch release moves one of these, this is the only file to change. Each helper says
which torch versions it was checked against.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import platform
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

import torch

MIN_TORCH = (2, 5)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_version_problem() -> Optional[str]:
    """Why this torch cannot run Kiln's compiler, or None. Checked: 2.5 - 2.14."""
    if torch_version() < MIN_TORCH:
        return (f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}: Kiln's compiler needs "
                "torch.library.custom_op and TorchDynamo's inlined nn.Module parameters; update torch")
    return None


def lookup_backend(name: str) -> Callable:
    """A registered TorchDynamo backend by name ("inductor", "cudagraphs", ...)."""
    return torch._dynamo.lookup_backend(name)


def inductor_backend(device: str) -> Callable:
    """Inductor as a backend for a graph that runs on `device`. For a CPU graph that is Inductor's
    compile itself (`compile_fx`), without what its registered backend does first when Triton is
    installed: start the worker processes that compile Triton kernels (a helper process and one
    worker per compile thread, each importing torch). A CPU graph's kernels are C++, built in
    threads, so those processes would only take the CPU from the lowering and from the timing of
    the region just compiled (on a 2-core CPU the first region's compiled/eager ratio, timed six
    times in one process while they started, spread over 0.20-3.85x; within 1.05-1.20x in three
    runs without them).
    Elsewhere the registered backend. Checked: torch 2.5 - 2.14."""
    if device == "cpu":
        from torch._inductor.compile_fx import compile_fx
        return compile_fx
    return lookup_backend("inductor")


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


def forget_code(code) -> None:
    """Drop TorchDynamo's record of guard failures for a code object nothing else will run again
    (a dead model's entry function): that record holds the code object, and with it every cache
    entry TorchDynamo keeps on the code: the model's compiled graphs."""
    from torch._dynamo.utils import guard_failures as failures

    failures.pop(code, None)


def cuda_graph_capture_gate(gate) -> Optional[Callable]:
    """A zero-argument factory of a context in which torch's CUDA graph trees ask `int_key in gate`
    before recording or replaying a shape (`triton.cudagraph_capture_sizes`, read on every call;
    checked: torch 2.11 - 2.13). Set and restored around the call (a ConfigScope), never left set.
    None, with a warning, where torch lacks the setting."""
    import torch._inductor.config as inductor_config

    if not is_inductor_option("triton.cudagraph_capture_sizes"):
        import logging

        logging.getLogger("kiln").warning(
            "Kiln: torch %s cannot bound CUDA graph recordings (no triton.cudagraph_capture_sizes): "
            "shapes.max_cuda_graphs is not enforced; every shape records its own CUDA graph", torch.__version__)
        return None
    return lambda: ConfigScope(inductor_config.triton, {"cudagraph_capture_sizes": gate})


def cuda_graph_capture_allowed(signature) -> bool:
    """Whether torch's CUDA graphs may record or replay for `signature`: what Inductor asks before each
    call of a CUDA-graphed graph (`is_cudagraph_capture_sizes`, answered by Kiln's budget while a Kiln
    call runs: cuda_graph_capture_gate; checked: torch 2.11, 2.13)."""
    from torch._inductor.cudagraph_trees import is_cudagraph_capture_sizes

    return is_cudagraph_capture_sizes(signature)


# Kiln's step numbers: far below any that mark_step_begin() counts down to, and far apart, so that
# other code marking steps inside a Kiln call never lands on Kiln's next number
KILN_STEPS_FROM = -(1 << 50)
KILN_STEP_SPACING = 1 << 20
_steps = itertools.count(1)


@contextlib.contextmanager
def cuda_graph_step():
    """One call of a Kiln model as one step ("generation") of torch's CUDA graph trees, however many
    compiled graphs it runs. By default the trees start a new step at every entry into compiled code
    from eager code, and a new step may reuse the memory of every output of the last: by blocks, the
    output of one region (a UNet's skip connection) would be overwritten by the next region's replay.
    Inside this context the step is the model call: the regions' graphs are recorded as one path,
    each block at its place with its own weights, and their outputs stay valid through the call. It
    does what `torch.compiler.cudagraph_mark_step_begin()` does, with a step number of Kiln's own
    that no other caller uses, and puts the process-wide marker back after (`MarkStepBox`, read on
    every call of a CUDA-graphed function; checked: torch 2.11, 2.13), so CUDA-graphed code of
    others keeps torch's own step rule. The marker is the process's: CUDA-graphed Kiln models are
    called from one thread at a time (as a ComfyUI server runs its prompts)."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    before = MarkStepBox.mark_step_counter
    if before <= KILN_STEPS_FROM:  # a Kiln model called inside another's call: the outer call is the step
        yield
        return
    MarkStepBox.mark_step_counter = KILN_STEPS_FROM - next(_steps) * KILN_STEP_SPACING
    try:
        yield
    finally:
        MarkStepBox.mark_step_counter = before


def map_tensors(fn: Callable[[torch.Tensor], Any], value):
    """`value` with `fn` applied to every tensor in it, through the containers torch's pytree knows
    (tuples, lists, dicts, namedtuples, and types registered with it, as diffusers registers its
    outputs); any other value is kept as it is (torch.utils._pytree.tree_map_only; checked: torch 2.5 - 2.14)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, value)


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


def fake_value(node: torch.fx.Node):
    """The fake tensor (or value) TorchDynamo recorded for an FX node, if any."""
    meta = node.meta
    return meta.get("example_value", meta.get("val"))


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


def inductor_cache_hits() -> int:
    """How many graphs Inductor has loaded from its on-disk FX graph cache in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


def is_inductor_option(name: str) -> bool:
    """True if `name` (dotted for nested, e.g. "triton.cudagraphs") is an Inductor config setting."""
    import torch._inductor.config as inductor_config

    return name in inductor_config.get_config_copy()


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


def size_expr(size):
    """A size from a fake tensor's shape: an int, or the sympy expression of a symbolic size (`s0`, `2*s1`)."""
    if isinstance(size, int):
        return size
    return size.node.expr  # torch.SymInt -> its sympy expression (checked: 2.5 - 2.13)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` with a graph of its own (node meta shallow-copied): lowering one copy through
    Inductor, which rewrites the graph it is given, leaves the other as TorchDynamo captured it.
    The copy keeps what marks a graph as TorchDynamo's for AOTAutograd (the module's meta, its
    `_param_name_to_source`, each input's `_dynamo_source`): from these it tells which inputs are
    weights, which Inductor's CUDA graphs (mode balanced's pinned shapes) then read in place instead
    of copying them at every replay; torch's `cudagraphs` backend ignores them (checked: torch 2.11 -
    2.13, `_try_get_metadata_from_dynamo`)."""
    graph = torch.fx.Graph()
    value, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value).meta = dict(output.meta)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for original, copied in zip(gm.graph.find_nodes(op="placeholder"), copy.graph.find_nodes(op="placeholder")):
        if hasattr(original, "_dynamo_source"):
            copied._dynamo_source = original._dynamo_source
    return copy


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


def call_module_body(module: torch.nn.Module, *args, **kwargs):
    """Call `module` with its hooks but past any compiled call installed on it (`Module._call_impl`,
    what `module(...)` runs when no `_compiled_call_impl` is set; checked: torch 2.5 - 2.14), so
    routing the module's calls elsewhere (`calls_routed`) never loops back."""
    return module._call_impl(*args, **kwargs)


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """`module` itself has forward or forward-pre hooks (`Module._forward_hooks` /
    `_forward_pre_hooks`; checked: torch 2.5 - 2.14)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def detect_cpu_vector_isa() -> None:
    """Let Inductor probe the CPU's vector instruction sets now, as its first CPU lowering would. It
    builds a test program per instruction set the CPU reports into its current cache directory,
    skipping any already built there, loads each in a child process, and keeps the answer for the
    process (`torch._inductor.cpu_vec_isa.valid_vec_isa_list`, cached; checked: torch 2.5 - 2.14).
    Inductor checks the sets one after another; here each set the CPU reports is checked in a thread
    of its own first (the work is compiler runs and child processes; each set keeps its answer on
    itself, `bool(isa)`, cached; `supported_vec_isa_list`, `x86_isa_checker`: checked as above), and
    Inductor's list is then made of those answers: on a 2-core CPU with AMX, 6 s instead of 12. Kiln's
    cache keeps the programs (compiler/cache/cpu_probe.py)."""
    from torch._inductor import cpu_vec_isa

    if sys.platform in ("linux", "win32") and platform.machine() in ("x86_64", "AMD64"):
        reported = cpu_vec_isa.x86_isa_checker()
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in reported for flag in str(isa).split())]
        if len(candidates) > 1:
            with ThreadPoolExecutor(len(candidates), thread_name_prefix="kiln-cpu-probe") as pool:
                list(pool.map(bool, candidates))
    cpu_vec_isa.valid_vec_isa_list()


_PROBE_CHILD = """
import os
try:  # the lowest share of a busy CPU (Linux; the compilers it starts inherit it)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    if hasattr(os, "nice"):
        os.nice(19)
try:  # a session of its own is a scheduling group of its own where the kernel groups sessions: lowest too
    with open("/proc/self/autogroup", "w") as group:
        group.write("19")
except OSError:
    pass
from torch._inductor import cpu_vec_isa
print(" ".join(sorted(str(isa).replace(" ", "+") for isa in cpu_vec_isa.valid_vec_isa_list())))
"""


def cpu_vector_isa_answer() -> str:
    """Inductor's answer to its probe in this process, as start_cpu_probe_child's child prints its own:
    the valid sets' names, sorted, spaces within a name as '+'."""
    from torch._inductor import cpu_vec_isa

    return " ".join(sorted(str(isa).replace(" ", "+") for isa in cpu_vec_isa.valid_vec_isa_list()))


def import_cpu_build_modules() -> None:
    """Import on this thread what Inductor's CPU probe and C++ builds import when first used
    (`torch._inductor.codecache`, `cpu_vec_isa`, `cpp_builder`, and `torch.utils.cpp_extension` with
    setuptools, which `cpp_builder` imports inside its functions; checked: torch 2.13 - 2.14), before a
    thread of Kiln's runs them: two threads importing one cycle of modules at the same time can see each
    other's half-made modules. About 0.04 s where torch.compile ran before, 0.4 s in a fresh process: time
    the first CPU lowering would spend on them anyway."""
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.cpp_builder  # noqa: F401
    import torch._inductor.cpu_vec_isa  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401


def import_inductor_compile() -> None:
    """Import Inductor's graph compiler (`torch._inductor.compile_fx`, with the kernel templates and
    autotuning modules it imports: about 0.8 s in a fresh process; checked: torch 2.13 - 2.14), as a
    process's first Inductor lowering does (inductor_backend)."""
    import torch._inductor.compile_fx  # noqa: F401


def cpu_probe_builds_programs() -> bool:
    """Whether Inductor's probe builds test programs here: an x86 CPU on Linux or Windows, and no
    `cpp.vec_isa_ok` answering for it (elsewhere it decides without building; checked: torch 2.5 - 2.14)."""
    from torch._inductor import config as inductor_config

    return (sys.platform in ("linux", "win32") and platform.machine() in ("x86_64", "AMD64")
            and inductor_config.cpp.vec_isa_ok is None)


def start_cpu_probe_child(cache_dir: str) -> subprocess.Popen:
    """Start Inductor's own probe of the CPU (`valid_vec_isa_list`, as detect_cpu_vector_isa) in a child
    process of this Python at the lowest priority (Linux: SCHED_IDLE, and its session's scheduling group
    at nice 19 where the kernel groups sessions; elsewhere nice 19, or Windows' idle class), in a
    session (POSIX) of its own, its Inductor cache directory and working folder `cache_dir`: it builds
    there the test programs a fresh process builds, without touching this process's answer (Inductor
    keeps it in caches that checking one set again would replace; checked: torch 2.5 - 2.14), and prints
    its answer as cpu_vector_isa_answer says this process's (a child starved past Inductor's 60 s limit
    on loading a program answers with fewer sets, and built fewer). Its output is piped (`communicate`
    it); OSError where no child can be started; stop_child stops it and what it started."""
    if not sys.executable:
        raise OSError("this Python does not know its own program (sys.executable is empty)")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    where = ({"creationflags": subprocess.IDLE_PRIORITY_CLASS} if sys.platform == "win32"
             else {"start_new_session": True})
    return subprocess.Popen([sys.executable, "-c", _PROBE_CHILD], env=env, cwd=cache_dir, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", **where)


def stop_child(child: subprocess.Popen, wait_seconds: float = 5.0) -> None:
    """Stop a child started by start_cpu_probe_child, with the compilers it started (its session, on
    POSIX), and wait for it a little."""
    if child.poll() is None:
        try:
            if sys.platform != "win32":
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
        except OSError:  # gone meanwhile, or not in a session of its own
            try:
                child.kill()
            except OSError:
                pass
    try:
        child.wait(timeout=wait_seconds)
    except subprocess.TimeoutExpired:
        pass


def inductor_header_dir() -> Optional[str]:
    """The folder where Inductor keeps the precompiled C++ headers its CPU kernels are built with, or
    None where it precompiles none (`torch._inductor.codecache._HEADER_DIR`, used while
    `cpp_cache_precompile_headers` is on, not on Windows; checked: torch 2.13 - 2.14):
    `precompiled_headers` in Inductor's default folder in the system's temporary folder, whatever
    TORCHINDUCTOR_CACHE_DIR says."""
    import torch._inductor.config as inductor_config

    if sys.platform == "win32" or not getattr(inductor_config, "cpp_cache_precompile_headers", False):
        return None
    from torch._inductor import codecache

    path = getattr(codecache, "_HEADER_DIR", None)
    return path if isinstance(path, str) else None


def cpu_kernel_header_build() -> tuple[Optional[Callable[[], str]], str]:
    """(build, why_not): `build()` has Inductor build the precompiled C++ header its CPU kernels are
    built with and returns its path, as its first CPU kernel of the process would (a kernel of the
    Python wrapper, built with no separate kernel code: `CppCodeCache.load_async`'s arguments to
    `codecache._precompile_header`, which keeps its answer for the process, takes a file lock per
    header and skips one already built; checked: torch 2.13 - 2.14). None, and why, where Inductor
    would build no such header: none precompiled here (inductor_header_dir), or its C++ wrapper on
    (`cpp_wrapper`: other headers, other flags). Made after the CPU probe (the instruction set is part
    of the header's name) in the caller's thread, which also does the imports; `build()` may then run
    in a thread of its own: it is compiler runs, most of them one gcc writing about 150 MB."""
    if inductor_header_dir() is None:
        return None, "Inductor precompiles no header here"
    from torch._inductor import codecache, cpu_vec_isa
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    if inductor_config.cpp_wrapper:
        return None, "Inductor's C++ wrapper is on (cpp_wrapper): its kernels are built with other headers"
    bindings = codecache.CppPythonBindingsCodeCache
    header = bindings._get_uncompiled_header("cpu")
    if header is None:
        return None, "Inductor precompiles no header for CPU kernels in this torch"
    command = {**bindings.cpp_compile_command_flags, "device_type": "cpu", "extra_flags": (),
               "use_relative_path": inductor_config.is_fbcode(), "vec_isa": cpu_vec_isa.pick_vec_isa()}
    option = CppTorchDeviceOptions(compile_only=False, min_optimize=False, **command)
    command_line = CppBuilder(name="o", sources="i", BuildOption=option).get_command_line()
    return (lambda: codecache._precompile_header(header, command_line, min_optimize=False, **command)), ""


def cpu_vector_isa_detected() -> bool:
    """Whether Inductor has probed the CPU in this process (its answer is cached: checked as above)."""
    from torch._inductor import cpu_vec_isa

    info = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    return info is not None and info().currsize > 0


def own_code(function, name: str):
    """A copy of `function` with a code object of its own, named `name`. TorchDynamo keeps compiled
    graphs and counts its recompile limit per code object (checked: torch 2.5 - 2.14): compiling a copy
    gives each model (and each block region) graphs and a budget of its own, freed with it, and where a
    graph breaks inside it TorchDynamo resumes in this code, not in code every caller shares."""
    code = function.__code__.replace(co_name=name)
    return type(function)(code, function.__globals__, name)


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
    try:
        yield
    finally:
        module._compiled_call_impl = previous


def is_view(tensor: torch.Tensor) -> bool:
    """`tensor` is a view of another tensor (autograd's view tracking: `Tensor._is_view`; checked:
    torch 2.5 - 2.14). Inference-mode tensors are never views."""
    return tensor._is_view()


def fresh_inductor_cache():
    """A context in which Inductor compiles into an empty cache (a temporary directory, its in-memory
    caches cleared), as on a machine that never compiled: for timing a cold compile next to
    others in one process (`torch._inductor.utils.fresh_inductor_cache`; checked: torch 2.5 - 2.14)."""
    from torch._inductor.utils import fresh_inductor_cache as fresh

    return fresh()


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
    left as is). With symbolic sizes a key hashes sympy expressions and a block's trace rarely
    repeats an op: a SD1.5 transformer block at CPU size captured in 0.63 s instead of 0.86 s
    (medians of five, one process), while AOTAutograd's trace after it, which repeats TorchDynamo's
    ops, took 1.04 s instead of 0.91 s; a warm start loads that trace from AOTAutograd's cache.
    With static sizes the cache pays: the whole SD1.5 UNet captured in 7.3 s with it, 11.2 s
    without (docs/compile-units.md)."""
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


def is_weight(node: torch.fx.Node) -> bool:
    """A placeholder of a captured graph that holds a parameter or buffer: TorchDynamo lifts them to
    placeholders named after them (its naming rule, e.g. L__self___conv_parameters_weight_)."""
    return "_parameters_" in node.name or "_buffers_" in node.name
