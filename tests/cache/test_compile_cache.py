"""Kiln's cache end to end, each run a fresh process as after a restart: a cold compile stores an entry;
the next process loads it with no Inductor compile and the same output; another weight set of the
same architecture hits and gives its own output; a changed Kiln option misses and says so; a region's
graph, compiled by blocks, loads the same way; a process whose first compile was uncached still keeps
Inductor's CPU probe and header for the next."""
import glob
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from kiln.compiler import compat
from kiln.compiler.cache import cpu_probe, entry_key, headers

pytestmark = pytest.mark.slow

CHILD = os.path.join(os.path.dirname(__file__), "cache_child.py")
PROBE_ENTRY = entry_key(cpu_probe.probe_fields()) + ".kiln"  # Inductor's CPU probe, kept beside the graphs
HEADER_ENTRY = entry_key(headers.header_fields()) + ".kiln"  # Inductor's precompiled headers, likewise


def graph_entries(root) -> list[str]:
    return [name for name in os.listdir(root / "cache" / "entries") if name not in (PROBE_ENTRY, HEADER_ENTRY)]


def header_files(inductor_dir) -> dict[str, bytes]:
    """What is in Inductor's header folder of the process that ran with `inductor_dir`."""
    found = {}
    for folder in glob.glob(os.path.join(f"{inductor_dir}-temp", "torchinductor_*", "precompiled_headers")):
        for name in os.listdir(folder):
            if os.path.isfile(os.path.join(folder, name)):
                found[name] = open(os.path.join(folder, name), "rb").read()
    return found


def run(cache_dir, seed, out, switch="auto", inductor_dir=None, model="small", first="") -> dict:
    """The child's report, with Kiln's log as "log"."""
    # a fresh Inductor cache and temporary folder (where Inductor keeps its precompiled headers): only Kiln's can help
    os.makedirs(f"{inductor_dir}-temp", mode=0o700)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), TMPDIR=f"{inductor_dir}-temp")
    done = subprocess.run([sys.executable, CHILD, str(cache_dir), str(seed), str(out), switch, model, first], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), log=done.stderr)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    root = tmp_path_factory.mktemp("kiln-cache")
    result = run(root / "cache", 0, root / "cold.pt", inductor_dir=root / "inductor-cold")
    return root, result


def test_a_cold_compile_stores_a_signed_entry(cold):
    root, result = cold
    (event,) = result["events"]
    assert event["outcome"] == "miss" and event["entry_bytes"] > 0 and result["fallback"] is None
    assert result["counts"]["fxgraph_cache_miss"] == 1
    assert graph_entries(root) == [event["key"] + ".kiln"]
    assert PROBE_ENTRY in os.listdir(root / "cache" / "entries")  # a CPU compile: the probe's programs kept


def test_a_fresh_process_loads_it_with_no_inductor_compile_and_the_same_output(cold):
    root, _ = cold
    result = run(root / "cache", 0, root / "warm.pt", inductor_dir=root / "inductor-warm")
    (event,) = result["events"]
    assert event["outcome"] == "hit" and event["seconds_saved"] > 0
    assert result["counts"]["fxgraph_cache_miss"] == 0 and result["counts"]["fxgraph_cache_hit"] == 1
    assert result["counts"]["autograd_cache_hit"] == 1 and result["counts"]["autograd_cache_miss"] == 0
    assert torch.equal(torch.load(root / "warm.pt"), torch.load(root / "cold.pt"))


def test_a_fresh_temporary_folder_gets_inductors_headers_back_and_builds_none(cold):
    """A restart after the temporary folder was cleared: the header the cold process built is written
    back from Kiln's cache (as Kiln writes a file: 0600), byte for byte, and Inductor builds no other
    (it names the one it needs)."""
    root, _ = cold
    if compat.inductor_header_dir() is None:
        pytest.skip("this torch precompiles no headers")
    built = header_files(root / "inductor-cold")
    assert any(name.endswith(".gch") for name in built) and HEADER_ENTRY in os.listdir(root / "cache" / "entries")
    run(root / "cache", 0, root / "headers.pt", inductor_dir=root / "inductor-headers")
    assert header_files(root / "inductor-headers") == built
    for path in glob.glob(os.path.join(f"{root / 'inductor-headers'}-temp", "torchinductor_*", "precompiled_headers",
                                       "*.gch")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # written back by Kiln, not built by gcc


def test_a_process_whose_first_compile_was_uncached_still_keeps_the_probe_and_the_header(tmp_path):
    """A server's first CPU compile did not use Kiln's cache: Inductor probed the CPU and built its header
    in its own folders. The first cached compile still stores both, and the next start, its temporary
    folder cleared, builds neither."""
    first = run(tmp_path / "cache", 0, tmp_path / "first.pt", inductor_dir=tmp_path / "inductor-first", first="uncached")
    assert "being built in the background" in first["log"]
    assert "stored its test programs in Kiln's cache (built in" in first["log"]
    entries = os.listdir(tmp_path / "cache" / "entries")
    assert PROBE_ENTRY in entries
    later = run(tmp_path / "cache", 0, tmp_path / "later.pt", inductor_dir=tmp_path / "inductor-later")
    assert "loaded its test programs from Kiln's cache" in later["log"]
    assert later["events"][0]["outcome"] == "hit"
    if compat.inductor_header_dir() is not None:
        assert HEADER_ENTRY in entries
        assert header_files(tmp_path / "inductor-later") == header_files(tmp_path / "inductor-first")


def test_another_weight_set_of_the_architecture_hits_with_its_own_output(cold):
    root, _ = cold
    result = run(root / "cache", 7, root / "other.pt", inductor_dir=root / "inductor-other")
    assert result["events"][0]["outcome"] == "hit" and result["counts"]["fxgraph_cache_miss"] == 0
    assert result["max_diff_vs_eager"] < 1e-5
    assert not torch.allclose(torch.load(root / "other.pt"), torch.load(root / "cold.pt"))


def test_a_changed_kiln_option_misses_and_names_it(cold):
    root, _ = cold
    result = run(root / "cache", 0, root / "option.pt", switch="off", inductor_dir=root / "inductor-option")
    (event,) = result["events"]
    assert event["outcome"] == "miss" and "options.passes.channels_last_convs: auto -> off" in event["reason"]
    assert len(graph_entries(root)) == 2


def test_a_region_graph_loads_in_a_fresh_process_with_no_inductor_compile_and_the_same_output(tmp_path):
    """By blocks: the one region's graph (three identical blocks) is stored by one process and loaded
    by the next with no Inductor compile and the same output."""
    cold = run(tmp_path / "cache", 0, tmp_path / "cold.pt", inductor_dir=tmp_path / "inductor-cold", model="blocks")
    assert cold["regions"] == 1 and cold["lowerings"] == ["inductor"] and cold["fallback"] is None
    assert [e["outcome"] for e in cold["events"]] == ["miss"] and cold["max_diff_vs_eager"] < 1e-5
    warm = run(tmp_path / "cache", 0, tmp_path / "warm.pt", inductor_dir=tmp_path / "inductor-warm", model="blocks")
    assert [e["outcome"] for e in warm["events"]] == ["hit"] and warm["lowerings"] == ["inductor (from Kiln's cache)"]
    assert warm["counts"]["fxgraph_cache_miss"] == 0 and warm["counts"]["fxgraph_cache_hit"] == 1
    assert torch.equal(torch.load(tmp_path / "warm.pt"), torch.load(tmp_path / "cold.pt"))
