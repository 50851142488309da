"""Kiln's cache end to end, each run a fresh process as after a restart: a cold compile stores an entry;
the next process loads it with no Inductor compile and the same output; another weight set of the
same architecture hits and gives its own output; a changed Kiln option misses and says so; a region's
graph, compiled by blocks, loads the same way."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

CHILD = os.path.join(os.path.dirname(__file__), "cache_child.py")


def graph_entries(root) -> list[str]:
    return sorted(os.listdir(root / "cache" / "entries"))


def run(cache_dir, seed, out, switch="auto", model="small") -> dict:
    """The child's report, with Kiln's log as "log". Inductor's own folders (TORCHINDUCTOR_CACHE_DIR, and
    TMPDIR, where it keeps its precompiled C++ headers) are the test session's, kept across the runs as a
    server's restart keeps them: Kiln lowers into folders of its own, so a graph reaches a later run only
    through Kiln's cache."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(INDUCTOR_DIR), TMPDIR=str(TEMP_DIR))
    done = subprocess.run([sys.executable, CHILD, str(cache_dir), str(seed), str(out), switch, model], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), log=done.stderr)


INDUCTOR_DIR = TEMP_DIR = None


@pytest.fixture(scope="module", autouse=True)
def _inductors_own_folders(tmp_path_factory):
    global INDUCTOR_DIR, TEMP_DIR
    root = tmp_path_factory.mktemp("inductor-own")
    INDUCTOR_DIR, TEMP_DIR = root / "inductor", root / "temp"
    os.makedirs(TEMP_DIR, mode=0o700)
    yield


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    root = tmp_path_factory.mktemp("kiln-cache")
    result = run(root / "cache", 0, root / "cold.pt")
    return root, result


def test_a_cold_compile_stores_a_signed_entry(cold):
    root, result = cold
    (event,) = result["events"]
    assert event["outcome"] == "miss" and event["entry_bytes"] > 0 and result["fallback"] is None
    assert result["counts"]["fxgraph_cache_miss"] == 1
    assert graph_entries(root) == [event["key"] + ".kiln"]  # the graph's entry only


def test_a_fresh_process_loads_it_with_no_inductor_compile_and_the_same_output(cold):
    root, _ = cold
    result = run(root / "cache", 0, root / "warm.pt")
    (event,) = result["events"]
    assert event["outcome"] == "hit" and event["seconds_saved"] > 0
    assert result["counts"]["fxgraph_cache_miss"] == 0 and result["counts"]["fxgraph_cache_hit"] == 1
    assert result["counts"]["autograd_cache_hit"] == 1 and result["counts"]["autograd_cache_miss"] == 0
    assert torch.equal(torch.load(root / "warm.pt"), torch.load(root / "cold.pt"))


def test_another_weight_set_of_the_architecture_hits_with_its_own_output(cold):
    root, _ = cold
    result = run(root / "cache", 7, root / "other.pt")
    assert result["events"][0]["outcome"] == "hit" and result["counts"]["fxgraph_cache_miss"] == 0
    assert result["max_diff_vs_eager"] < 1e-5
    assert not torch.allclose(torch.load(root / "other.pt"), torch.load(root / "cold.pt"))


def test_a_changed_kiln_option_misses_and_names_it(cold):
    root, _ = cold
    result = run(root / "cache", 0, root / "option.pt", switch="off")
    (event,) = result["events"]
    assert event["outcome"] == "miss" and "options.passes.channels_last_convs: auto -> off" in event["reason"]
    assert len(graph_entries(root)) == 2


def test_a_region_graph_loads_in_a_fresh_process_with_no_inductor_compile_and_the_same_output(tmp_path):
    """By blocks: the one region's graph (three identical blocks) is stored by one process and loaded
    by the next with no Inductor compile and the same output."""
    cold = run(tmp_path / "cache", 0, tmp_path / "cold.pt", model="blocks")
    assert cold["regions"] == 1 and cold["lowerings"] == ["inductor"] and cold["fallback"] is None
    assert [e["outcome"] for e in cold["events"]] == ["miss"] and cold["max_diff_vs_eager"] < 1e-5
    warm = run(tmp_path / "cache", 0, tmp_path / "warm.pt", model="blocks")
    assert [e["outcome"] for e in warm["events"]] == ["hit"] and warm["lowerings"] == ["inductor (from Kiln's cache)"]
    assert warm["counts"]["fxgraph_cache_miss"] == 0 and warm["counts"]["fxgraph_cache_hit"] == 1
    assert torch.equal(torch.load(tmp_path / "warm.pt"), torch.load(tmp_path / "cold.pt"))
