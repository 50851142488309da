"""compiler/cpu/lowering.py: what a lowering on a CPU needs first: Inductor's CPU probe once a process, in
Inductor's own folder (checked in parallel), and Inductor's compile without the Triton worker processes."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kiln import CompileOptions
from kiln.compiler import cpu
from kiln.compiler.backend import lowering
from kiln.compiler.options.modes import LOWERINGS
from kiln.compiler.torch_compat import inductor


def _graph():
    return torch.fx.symbolic_trace(lambda x, n: (x * 2).sum() + n)


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
    monkeypatch.setattr(inductor.sys, "platform", "linux")
    monkeypatch.setattr(inductor.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", sets)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512", "avx512_vnni", "amx_tile"])
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: asked.append([s.thread for s in sets]))
    inductor.detect_cpu_vector_isa(in_parallel=True)
    checked = asked[0][:3]
    assert all(name.startswith("kiln-cpu-probe") for name in checked) and len(set(checked)) == 3
    assert asked[0][3] is None                  # a set the CPU does not report is left to Inductor
    assert checks["most_at_once"] == 3          # side by side, not one after another


def test_the_probe_runs_once_a_process_before_a_cpu_lowering_and_never_for_a_cuda_one(monkeypatch):
    probes = []
    monkeypatch.setattr(inductor, "cpu_vector_isa_detected", lambda: bool(probes))
    monkeypatch.setattr(inductor, "detect_cpu_vector_isa", lambda in_parallel=False: probes.append(in_parallel))
    cpu.before_lowering("cuda")
    assert probes == []
    cpu.before_lowering("cpu")
    cpu.before_lowering("cpu")
    assert probes == [True]


def test_a_kiln_lowering_probes_in_inductors_own_folder_before_kilns_cache_points_it_elsewhere(tmp_path, monkeypatch):
    """With Kiln's cache a graph is lowered in a fresh private folder; the probe runs before that, in
    Inductor's own folder, where the next process finds its test programs built."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    import kiln

    where = []
    monkeypatch.setattr(inductor, "cpu_vector_isa_detected", lambda: bool(where))
    monkeypatch.setattr(inductor, "detect_cpu_vector_isa", lambda in_parallel=False: where.append(cache_dir()))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-own"))
    lowered_in = []
    real = lowering.lower_graph
    monkeypatch.setattr(lowering, "lower_graph",
                        lambda self, *args, **kwargs: lowered_in.append(cache_dir()) or real(self, *args, **kwargs))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with torch.no_grad():
        kiln.compile(model, options=CompileOptions(compile_unit="whole"), cache_dir=str(tmp_path / "kiln"))(
            torch.randn(2, 4))
    assert where == [str(tmp_path / "inductor-own")]
    assert lowered_in and lowered_in[0] != where[0]  # the lowering itself: Kiln's private folder


PROBE_CHILD = """
import sys
from torch._inductor import cpu_vec_isa
if sys.argv[1] == "kiln":
    from kiln.compiler.torch_compat import inductor
    inductor.detect_cpu_vector_isa(in_parallel=True)
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
    monkeypatch.setattr(inductor, "cpu_vector_isa_detected", lambda: True)
    balanced = LOWERINGS["balanced"]
    gm = _graph()
    compiled, name = lowering.lower_graph(balanced, gm, [torch.ones(2, 3), 1], CompileOptions(), "cpu")
    assert lowered == [gm] and started == [] and name == "inductor" and compiled(torch.ones(2, 3), 1) == 13
    lowering.lower_graph(balanced, gm, [torch.ones(2, 3), 1], CompileOptions(), "cuda")
    assert lowered == [gm, gm] and started == [1]  # the registered backend: its workers, then the same compile


WORKERS_CHILD = """
import os, torch
from torch._inductor.async_compile import AsyncCompile
from kiln import CompileOptions
from kiln.compiler.torch_compat import dynamo
from kiln.compiler.backend import lowering
from kiln.compiler.options.modes import LOWERINGS

def children():
    found = []
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/children") as listed:
            found += listed.read().split()
    return len(found)

def graph():
    return torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)

compiled, _ = lowering.lower_graph(LOWERINGS["balanced"], graph(), [torch.ones(4)], CompileOptions(), "cpu")
assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 2.0))
print("kiln", AsyncCompile.process_pool.cache_info().currsize, children())
dynamo.lookup_backend("inductor")(graph(), [torch.ones(4)])
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
