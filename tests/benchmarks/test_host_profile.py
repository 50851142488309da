"""The host profile (benchmarks/host_profile.py): checked on the CPU with a tiny SD1.5, so it cannot rot
before a CUDA machine runs it. What it reports on a GPU (launches, synchronisations, busy time)
needs one; what is checked here is the timing, the cProfile table and the result files."""
import json
import math

import pytest

from kiln.benchmarks import host_profile


def test_top_functions_are_the_ones_with_the_most_time_of_their_own():
    def busy():
        return sum(math.sqrt(i) for i in range(20000))

    def step():
        busy()
        return len("x")

    top = host_profile.top_functions(step, steps=4, count=3)
    assert len(top) == 3
    assert top[0].ms_per_step >= top[1].ms_per_step >= top[2].ms_per_step > 0
    assert any("busy" in row.where or "genexpr" in row.where for row in top[:2])
    assert all(row.calls_per_step > 0 for row in top)


def test_a_path_is_named_from_its_package():
    assert host_profile._short("/opt/venv/lib/python3.12/site-packages/torch/nn/modules/module.py") == \
        "torch/nn/modules/module.py"
    assert host_profile._short("~") == "~"


def test_the_tiny_run_writes_its_results(tmp_path):
    assert host_profile.main(["--tiny", "--variants", "eager,kiln fast", "--reps", "3", "--steps", "1",
                              "--top", "4", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("host-*-sd15-tiny.json")).read_text())
    rows = {row["variant"]: row for row in data["results"]}
    assert [row["variant"] for row in data["results"]] == ["eager", "kiln fast", host_profile.EAGER_AGAIN]
    for name in ("eager", "kiln fast"):
        row = rows[name]
        assert row["error"] is None and row["ms"] > 0 and row["host_ms"] > 0
        assert len(row["top"]) == 4
        assert row["busy_ms"] is None and row["launches"] is None  # CUDA only
    again = rows[host_profile.EAGER_AGAIN]  # eager timed again last: how far the conditions moved over the run
    assert again["error"] is None and again["ms"] > 0 and again["host_ms"] > 0 and again["top"] == []
    assert "kiln fast" in next(tmp_path.glob("host-*-sd15-tiny.log")).read_text()


def test_a_run_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    def stopped(module):  # what a time limit does to the run in the middle of a row
        raise KeyboardInterrupt

    monkeypatch.setitem(host_profile.VARIANTS, "stopped", stopped)
    with pytest.raises(KeyboardInterrupt):
        host_profile.main(["--tiny", "--variants", "eager,stopped,kiln fast", "--reps", "3", "--steps", "1",
                           "--top", "2", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("host-*-sd15-tiny.json")).read_text())["results"]
    assert [row["variant"] for row in rows] == ["eager"] and rows[0]["ms"] > 0


def test_an_unknown_variant_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        host_profile.main(["--tiny", "--variants", "eager,turbo", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "turbo" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran
