"""compiler/backend/lowering.py: what each mode's lowering makes of a graph. Mode fast with CUDA graphs records
one CUDA graph per input shape signature (torch's `cudagraphs` backend alone records the first
shapes and fails at the first new size, seen on an H200); the recordings themselves need a GPU
(tests/gpu), the bookkeeping is checked here with torch's backend replaced by a stand-in."""
import operator
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch._inductor.config as inductor_config

from kiln import CompileOptions
from kiln.compiler import compat
from kiln.compiler.backend import lowering


class _Backend:
    """Stands in for torch's `cudagraphs` backend: says which signatures it was made for."""

    def __init__(self):
        self.made_for = []

    def __call__(self, gm, example_inputs):
        self.made_for.append(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in example_inputs))
        return lambda *args: ("recorded", gm(*args))


def _graph():
    return torch.fx.symbolic_trace(lambda x, n: (x * 2).sum() + n)


def test_fast_mode_records_one_cuda_graph_per_signature(monkeypatch):
    backend = _Backend()
    monkeypatch.setattr(compat, "lookup_backend", lambda name: backend if name == "cudagraphs" else None)
    per_shape = lowering.CudaGraphsPerShape(_graph())
    two, four = torch.ones(2, 3), torch.ones(4, 3)
    assert per_shape(two, 1) == ("recorded", 13)
    assert per_shape(four, 1) == ("recorded", 25)   # a new batch: a recording of its own, not batch 2's buffers
    assert per_shape(two, 1) == ("recorded", 13)    # batch 2 again: its first recording
    assert per_shape(two, 5) == ("recorded", 17)    # an integer input is part of the signature
    assert backend.made_for == [((2, 3),), ((4, 3),), ((2, 3),)]  # each made with its integer written in


def test_the_real_aot_path_serves_two_batches_under_inference_mode(monkeypatch):
    """What torch's `cudagraphs` backend does before recording (AOTAutograd on the captured graph,
    here with `aot_eager` in its place, since recording needs a GPU), on a graph TorchDynamo captured
    with dynamic sizes and a weight as an input, called at two batch sizes as a ComfyUI sampler does."""
    monkeypatch.setattr(compat, "lookup_backend", lambda name: torch._dynamo.lookup_backend("aot_eager"))
    made = []

    def backend(gm, example_inputs):
        made.append(lowering.CudaGraphsPerShape(gm))
        return made[-1]

    linear = torch.nn.Linear(3, 5)
    compiled = torch.compile(lambda x: torch.relu(linear(x)).sum(dim=-1), backend=backend, dynamic=True)
    with torch.inference_mode():
        for batch in (2, 4, 2):
            x = torch.randn(batch, 3)
            assert torch.allclose(compiled(x), torch.relu(linear(x)).sum(dim=-1))
    assert len(made) == 1 and len(made[0].by_signature) == 2  # one per batch, batch 2 served twice
    torch._dynamo.reset()


def test_torchs_own_cudagraphs_backend_takes_a_graph_captured_with_dynamic_sizes():
    """torch's `cudagraphs` backend itself (on a CPU it traces the graph, checks it for input mutations,
    then declines to record for the CPU device): a graph TorchDynamo captured with dynamic sizes takes
    them as integer inputs, and the backend failed on those ("KeyError: 'fake_result'" for every
    region of mode fast with CUDA graphs, seen on an H100) until each recording was made with its
    signature's sizes written in."""
    made = []

    def backend(gm, example_inputs):
        made.append(lowering.CudaGraphsPerShape(gm))
        return made[-1]

    linear = torch.nn.Linear(3, 5)
    compiled = torch.compile(lambda x: torch.relu(linear(x)).reshape(x.shape[0], -1, 5).sum(dim=1),
                             backend=backend, dynamic=True)
    try:
        with torch.inference_mode():
            for batch in (2, 4, 2):
                x = torch.randn(batch * 2, 3)
                expected = torch.relu(linear(x)).reshape(batch * 2, -1, 5).sum(dim=1)
                assert torch.allclose(compiled(x), expected)
    finally:
        torch._dynamo.reset()
    per_shape = made[0]
    assert any(not isinstance(n.meta.get("example_value"), torch.Tensor)
               for n in per_shape.gm.graph.nodes if n.op == "placeholder")  # a size among the graph's inputs
    assert len(made) == 1 and len(per_shape.by_signature) == 2


def _graph_using_its_sizes() -> torch.fx.GraphModule:
    """x.reshape(n, -1) * scale + n.__mul__(2), torch.full((n,), fill_value=scale), and n, as TorchDynamo
    records them: sizes in an operator, a method called on a size, a keyword argument, the output."""
    graph = torch.fx.Graph()
    x, n, scale = graph.placeholder("x"), graph.placeholder("n"), graph.placeholder("scale")
    doubled = graph.call_method("__mul__", (n, 2))
    reshaped = graph.call_method("reshape", (x, n, -1))
    scaled = graph.call_function(operator.add, (graph.call_function(operator.mul, (reshaped, scale)), doubled))
    filled = graph.call_function(torch.full, ((n,),), {"fill_value": scale})
    graph.output((scaled, filled, n))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_graph_for_a_signature_has_its_sizes_written_in():
    gm = _graph_using_its_sizes()
    args = [torch.arange(6.0), 2, 0.5]
    sized, takes = lowering.graph_for_signature(gm, args, keyed=[0, 1, 2])
    assert takes == [0]
    assert [n.op for n in sized.graph.nodes].count("placeholder") == 1
    for got, expected in zip(sized(torch.arange(6.0)), gm(*args)):  # in an operator, a method call, a call, the output
        assert got == expected if isinstance(expected, int) else torch.equal(got, expected)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 3  # the captured graph is left as it was
    with pytest.raises(ValueError, match="not part of the shape signature"):  # a value the signature does not key
        lowering.graph_for_signature(gm, args, keyed=[0, 2])
    with pytest.raises(ValueError, match="takes 3 inputs"):
        lowering.graph_for_signature(gm, args[:2], keyed=[0, 1, 2])


def test_a_weight_is_not_part_of_the_signature_and_a_failure_is_a_failed_lowering(monkeypatch):
    weight = torch.nn.Parameter(torch.ones(3))
    gm = torch.fx.symbolic_trace(lambda x, w: x * w)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    monkeypatch.setattr(compat, "is_weight", lambda node: node is placeholders[1])
    backend = _Backend()
    monkeypatch.setattr(compat, "lookup_backend", lambda name: backend)
    per_shape = lowering.CudaGraphsPerShape(gm)
    per_shape(torch.ones(2, 3), weight)
    per_shape(torch.ones(2, 3), torch.nn.Parameter(torch.ones(3)))  # another block's weight: same recording
    assert len(per_shape.by_signature) == 1

    def fails(gm, example_inputs):
        raise RuntimeError("no memory for the pool")

    monkeypatch.setattr(compat, "lookup_backend", lambda name: fails)
    with pytest.raises(lowering.LoweringFailed, match="no memory for the pool") as failed:
        per_shape(torch.ones(4, 3), weight)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert len(per_shape.by_signature) == 1  # nothing kept of the failed one


def test_a_failed_lowering_sends_the_call_to_eager_like_a_failed_compile():
    from kiln.compiler.backend.dynamo_backend import KilnBackend
    from kiln.compiler.options.compile_options import CompileOptions
    from kiln.compiler.stats import KilnStats

    options = CompileOptions()
    backend = KilnBackend(options, KilnStats(options.as_dict()))
    fell_back = []

    def call():
        raise lowering.LoweringFailed("CUDA graphs for a new shape could not be made: RuntimeError: x")

    assert backend.run(call, lambda: "eager answer", lambda reason, exc: fell_back.append(reason)) == "eager answer"
    assert fell_back and "could not be made" in fell_back[0]


def test_a_signature_the_budget_refuses_runs_without_cuda_graphs(monkeypatch):
    backend = _Backend()
    monkeypatch.setattr(compat, "lookup_backend", lambda name: backend)
    per_shape = lowering.CudaGraphsPerShape(_graph())
    allowed = {(((2, 3), (3, 1)), 1)}  # a signature: each activation's shape and strides
    with inductor_config.patch({"triton.cudagraph_capture_sizes": allowed}):  # what Kiln's budget answers
        assert per_shape(torch.ones(2, 3), 1) == ("recorded", 13)
        assert per_shape(torch.ones(4, 3), 1) == 25     # refused: the captured graph as it is
    assert backend.made_for == [((2, 3),)]


def test_fast_mode_lowers_to_the_per_signature_recorder_only_with_cuda_graphs_on_cuda():
    from kiln.compiler.options.compile_options import CompileOptions

    gm = _graph()
    fast = lowering.LOWERINGS["fast"]
    lowered, name = fast.lower(gm, [torch.ones(2, 3), 1], CompileOptions(mode="fast", cuda_graphs=True), "cuda")
    assert isinstance(lowered, lowering.CudaGraphsPerShape) and name == "fx + cudagraphs"
    lowered, name = fast.lower(gm, [torch.ones(2, 3), 1], CompileOptions(mode="fast", cuda_graphs=True), "cpu")
    assert name == "fx" and lowered(torch.ones(2, 3), 1) == 13


def test_mode_fast_with_cuda_graphs_says_once_that_its_recordings_copy_the_weights(monkeypatch, caplog):
    import logging

    from kiln.compiler.backend import dynamo_backend as backend_module
    from kiln.compiler.stats import KilnStats

    monkeypatch.setattr(backend_module, "device_type_of", lambda inputs: "cuda")  # what a CUDA model's inputs say
    for mode, said in (("fast", 1), ("balanced", 0)):
        options = CompileOptions(mode=mode, cuda_graphs=True)
        stats = KilnStats(options.as_dict())
        monkeypatch.setattr(compat, "inductor_backend", lambda device: lambda gm, args: gm.forward)
        with caplog.at_level(logging.WARNING, logger="kiln"):
            caplog.clear()
            for _ in range(2):  # two graphs of one model (its regions share its stats)
                backend_module.KilnBackend(options, stats)(_graph(), [torch.ones(2, 3), 1])
        notes = [r.getMessage() for r in caplog.records if "copies the weights" in r.getMessage()]
        assert len(notes) == said and len([w for w in stats.warnings if "copies the weights" in w]) == said, mode


class _VectorSet:
    """Stands in for one of Inductor's vector instruction sets: its check (`bool`) takes a while and
    records in which thread it ran and how many checks of its `checks` ran at once."""

    def __init__(self, name, checks):
        self.name, self.checks, self.thread = name, checks, None

    def __str__(self):
        return self.name

    def __bool__(self):
        with self.checks["lock"]:
            self.checks["running"] += 1
            self.checks["most_at_once"] = max(self.checks["most_at_once"], self.checks["running"])
        self.thread = threading.current_thread().name
        time.sleep(0.2)
        with self.checks["lock"]:
            self.checks["running"] -= 1
        return True


def test_the_cpu_probe_checks_each_reported_set_in_a_thread_of_its_own_then_asks_inductor(monkeypatch):
    from torch._inductor import cpu_vec_isa

    checks = {"lock": threading.Lock(), "running": 0, "most_at_once": 0}
    sets = [_VectorSet(name, checks) for name in ("avx512 avx512_vnni amx_tile", "avx512", "avx2", "asimd")]
    asked = []
    monkeypatch.setattr(compat.sys, "platform", "linux")
    monkeypatch.setattr(compat.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", sets)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512", "avx512_vnni", "amx_tile"])
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: asked.append([s.thread for s in sets]))
    compat.detect_cpu_vector_isa()
    checked = asked[0][:3]
    assert all(name.startswith("kiln-cpu-probe") for name in checked) and len(set(checked)) == 3
    assert asked[0][3] is None                  # a set the CPU does not report is left to Inductor
    assert checks["most_at_once"] == 3          # side by side, not one after another


def test_a_cpu_lowering_probes_once_a_process_and_a_cuda_one_never(monkeypatch):
    probes = []
    monkeypatch.setattr(compat, "cpu_vector_isa_detected", lambda: bool(probes))
    monkeypatch.setattr(compat, "detect_cpu_vector_isa", lambda: probes.append(1))
    monkeypatch.setattr(compat, "inductor_backend", lambda device: lambda gm, args: gm.forward)
    balanced = lowering.LOWERINGS["balanced"]
    options = CompileOptions()
    balanced.lower(_graph(), [torch.ones(2)], options, "cuda")
    assert probes == []
    balanced.lower(_graph(), [torch.ones(2)], options, "cpu")
    balanced.lower(_graph(), [torch.ones(2)], options, "cpu")
    assert probes == [1]


@pytest.fixture
def header_ahead(monkeypatch):
    """A process that has not asked for Inductor's CPU header yet, its probe done, Inductor's lowering
    replaced by the graph itself; the build set with `header_ahead(build)` (None: as torch has it)."""
    monkeypatch.setattr(lowering, "_header_asked", False)
    monkeypatch.setattr(lowering, "_header_thread", None)
    monkeypatch.setattr(compat, "cpu_vector_isa_detected", lambda: True)
    monkeypatch.setattr(compat, "inductor_backend", lambda device: lambda gm, args: gm.forward)

    def set_build(build, why_not=""):
        monkeypatch.setattr(compat, "cpu_kernel_header_build", lambda: (build, why_not))

    return set_build


def _lower_on(device):
    return lowering.LOWERINGS["balanced"].lower(_graph(), [torch.ones(2), 1], CompileOptions(), device)


def test_a_cpu_lowering_builds_inductors_header_ahead_once_a_process_in_a_thread_and_a_cuda_one_never(header_ahead):
    built = []
    header_ahead(lambda: built.append(threading.current_thread().name))
    _lower_on("cuda")
    assert lowering._header_thread is None
    _lower_on("cpu")
    thread = lowering._header_thread
    _lower_on("cpu")
    thread.join(timeout=10)
    assert lowering._header_thread is thread and built == ["kiln-cpu-header"]


GCC_FAILED = """In file included from /tmp/torchinductor_me/precompiled_headers/cabc.h:1:
/usr/include/c++/12/cmath:45:15: fatal error: math.h: No such file or directory
   45 | #include_next <math.h>
      |               ^~~~~~~~
compilation terminated.
"""


def test_a_header_build_ahead_that_fails_says_the_compilers_error_and_the_lowering_goes_on(header_ahead, caplog):
    def fails():
        raise subprocess.CalledProcessError(1, ["g++", "-x", "c++-header"], output=GCC_FAILED)

    header_ahead(fails)
    with caplog.at_level("WARNING", logger="kiln"):
        compiled, _ = _lower_on("cpu")
        lowering._header_thread.join(timeout=10)
    assert compiled(torch.ones(2), 1) == 5
    said = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
    assert len(said) == 1 and "CalledProcessError: /usr/include/c++/12/cmath:45:15: fatal error: math.h" in said[0]
    assert "Inductor builds it at its first kernel" in said[0]


def test_a_torch_whose_header_build_cannot_be_made_still_lowers_and_says_so(header_ahead, monkeypatch, caplog):
    def cannot():
        raise AttributeError("type object 'CppPythonBindingsCodeCache' has no attribute 'cpp_compile_command_flags'")

    header_ahead(None)
    monkeypatch.setattr(compat, "cpu_kernel_header_build", cannot)
    with caplog.at_level("WARNING", logger="kiln"):
        compiled, _ = _lower_on("cpu")
    said = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
    assert compiled(torch.ones(2), 1) == 5 and lowering._header_thread is None
    assert len(said) == 1 and "AttributeError: type object 'CppPythonBindingsCodeCache'" in said[0]


def test_a_failure_is_said_by_the_line_naming_the_error_wherever_the_exception_keeps_it():
    from torch._inductor.exc import CppCompileError

    clang = "kernel.cpp:3:1: error: unknown type name 'vec'\n1 error generated.\n"
    assert lowering._failure_text(CppCompileError(["g++"], GCC_FAILED)).endswith("fatal error: math.h: No such file or directory")
    assert lowering._failure_text(subprocess.CalledProcessError(1, ["clang++"], output=None, stderr=clang.encode())) == (
        "CalledProcessError: kernel.cpp:3:1: error: unknown type name 'vec'")
    assert lowering._failure_text(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"
    assert lowering._failure_text(RuntimeError("")) == "RuntimeError"


def test_a_thread_that_cannot_start_is_said_and_the_lowering_goes_on(header_ahead, monkeypatch, caplog):
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    header_ahead(lambda: None)
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with caplog.at_level("WARNING", logger="kiln"):
        compiled, _ = _lower_on("cpu")
    said = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
    assert compiled(torch.ones(2), 1) == 5 and lowering._header_thread is None
    assert len(said) == 1 and "RuntimeError: can't start new thread" in said[0]


def test_where_inductor_builds_no_such_header_none_is_built_ahead_and_the_log_says_why(header_ahead, caplog):
    header_ahead(None, "Inductor's C++ wrapper is on (cpp_wrapper): its kernels are built with other headers")
    with caplog.at_level("INFO", logger="kiln"):
        _lower_on("cpu")
        _lower_on("cpu")
    said = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
    assert lowering._header_thread is None and len(said) == 1 and "cpp_wrapper" in said[0]


def test_with_inductors_cpp_wrapper_on_no_header_is_built_ahead(monkeypatch):
    if compat.inductor_header_dir() is None:
        pytest.skip("Inductor precompiles no header here, C++ wrapper or not")
    assert compat.cpu_kernel_header_build()[0] is not None  # off, as torch has it: one is built
    monkeypatch.setattr(inductor_config, "cpp_wrapper", True)
    build, why_not = compat.cpu_kernel_header_build()
    assert build is None and "cpp_wrapper" in why_not


def test_the_header_built_ahead_is_the_one_inductors_next_cpu_kernel_asks_for(monkeypatch):
    """The real build (about 6 s on a 2-core CPU the first time on a machine; a check after that):
    Inductor's next CPU kernel asks for the header with the same arguments, so it finds it built and
    builds no other. Recorded at the call, whatever Inductor's own cache of answers holds."""
    from torch._inductor import codecache

    build, why_not = compat.cpu_kernel_header_build()
    if build is None:
        pytest.skip(why_not)
    asked = []
    real = codecache._precompile_header
    monkeypatch.setattr(codecache, "_precompile_header",
                        lambda *args, **kwargs: asked.append((args, list(kwargs.items()))) or real(*args, **kwargs))
    path = build()
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(torch.sin(x) * 1.2345 + 0.5))  # a kernel new to this process
    with compat.fresh_inductor_cache():
        compiled = compat.inductor_backend("cpu")(gm, [torch.ones(64, 64)])
        out = compiled(torch.ones(64, 64))
    expected = torch.relu(torch.sin(torch.ones(64, 64)) * 1.2345 + 0.5)
    assert torch.allclose(out[0] if isinstance(out, (tuple, list)) else out, expected)
    assert len(asked) == 2 and asked[1] == asked[0] and os.path.isfile(path)


PROBE_CHILD = """
import sys
from torch._inductor import cpu_vec_isa
if sys.argv[1] == "kiln":
    from kiln.compiler import compat
    compat.detect_cpu_vector_isa()
print([str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()], str(cpu_vec_isa.pick_vec_isa()))
"""


@pytest.mark.slow
def test_the_parallel_probe_finds_what_inductors_own_finds(tmp_path):
    """The real probe, each way in a fresh process with an empty Inductor cache directory (about 20 s
    together on a 2-core CPU): the same instruction sets, and the same one picked."""
    answers = {}
    for way in ("inductor", "kiln"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / way))
        done = subprocess.run([sys.executable, "-c", PROBE_CHILD, way], env=env, capture_output=True, text=True,
                              check=True)
        answers[way] = done.stdout.strip().splitlines()[-1]
    assert answers["kiln"] == answers["inductor"] and "[]" not in answers["kiln"]


def test_a_cpu_graph_is_lowered_by_inductors_compile_without_starting_its_triton_workers(monkeypatch):
    """Inductor's registered backend first starts the processes that compile Triton kernels; a CPU
    graph has none, so Kiln calls Inductor's compile itself for it. Other devices keep the backend."""
    from torch._inductor import async_compile
    from torch._inductor import compile_fx as inductor_compile

    started, lowered = [], []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(1))
    monkeypatch.setattr(inductor_compile, "compile_fx", lambda gm, args: lowered.append(gm) or gm.forward)
    monkeypatch.setattr(compat, "cpu_vector_isa_detected", lambda: True)
    balanced = lowering.LOWERINGS["balanced"]
    gm = _graph()
    compiled, name = balanced.lower(gm, [torch.ones(2, 3), 1], CompileOptions(), "cpu")
    assert lowered == [gm] and started == [] and name == "inductor" and compiled(torch.ones(2, 3), 1) == 13
    balanced.lower(gm, [torch.ones(2, 3), 1], CompileOptions(), "cuda")
    assert lowered == [gm, gm] and started == [1]  # the registered backend: its workers, then the same compile


WORKERS_CHILD = """
import os, torch
from torch._inductor.async_compile import AsyncCompile
from kiln import CompileOptions
from kiln.compiler import compat
from kiln.compiler.backend import lowering

def children():
    found = []
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/children") as listed:
            found += listed.read().split()
    return len(found)

def graph():
    return torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)

compiled, _ = lowering.LOWERINGS["balanced"].lower(graph(), [torch.ones(4)], CompileOptions(), "cpu")
assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 2.0))
print("kiln", AsyncCompile.process_pool.cache_info().currsize, children())
compat.lookup_backend("inductor")(graph(), [torch.ones(4)])
print("inductor", AsyncCompile.process_pool.cache_info().currsize, children())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts child processes in /proc")
def test_a_real_cpu_lowering_starts_no_worker_process_where_inductors_backend_does():
    """In a fresh process (about 15 s on a 2-core CPU): Kiln lowers a graph on the CPU and no process
    is started; Inductor's registered backend, asked next in the same process, starts its workers
    (Triton is installed with Kiln), so the count would see them."""
    pytest.importorskip("triton")  # without it Inductor's backend starts no workers either
    done = subprocess.run([sys.executable, "-c", WORKERS_CHILD], capture_output=True, text=True, check=True)
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert lines["kiln"] == "0 0"
    pools, processes = map(int, lines["inductor"].split())
    assert pools == 1 and processes >= 1
