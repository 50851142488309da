"""benchmarks/kernel_pass_records.py measures on a GPU; here the records its rows make, the merge into the
shipped records and its argument checks."""
import json

import pytest

from kiln.benchmarks import kernel_pass_records
from kiln.benchmarks.kernel_pass_records import WITHOUT, records_from_rows
from kiln.compiler.passes.kernel_records import GpuClass, load_records, records_text

H200 = GpuClass("NVIDIA H200", "sm_90")


def _rows():
    return [{"variant": WITHOUT, "ms": 40.0, "busy_ms": 30.0, "rewrites": 0},
            {"variant": "fuse_geglu", "ms": 40.5, "busy_ms": 30.4, "rewrites": 70},
            {"variant": "fuse_group_norm_silu", "ms": 39.0, "busy_ms": 29.0, "rewrites": 35},
            {"variant": "fuse_adaln_modulation", "ms": 40.0, "busy_ms": 30.0, "rewrites": 0},
            {"variant": "broken", "error": "RuntimeError: out of memory"}]


def test_each_pass_that_rewrote_gets_a_record_against_the_step_without_kernel_passes():
    records, notes = records_from_rows(_rows(), H200, "sdxl-1024-cfg", "2026-12-02", "2.13.0", "benchmarks/results/x.json")
    assert [(r.kernel_pass, r.busy_with_ms, r.busy_without_ms, r.wins) for r in records] == [
        ("fuse_geglu", 30.4, 30.0, False), ("fuse_group_norm_silu", 29.0, 30.0, True)]
    assert records[0].gpu == "NVIDIA H200" and records[0].capability == "sm_90" and records[0].step_with_ms == 40.5
    assert notes == ["fuse_adaln_modulation: no record: it rewrote nothing at sdxl-1024-cfg",
                     "broken: no record: RuntimeError: out of memory"]


def test_without_the_step_without_kernel_passes_no_record_is_made():
    records, notes = records_from_rows(_rows()[1:], H200, "sdxl-1024-cfg", "2026-12-02", "2.13.0", "x")
    assert not records and notes[0].startswith("no record: the step without kernel passes did not run")


def test_records_from_results_files_merge_into_the_records_file(tmp_path, capsys):
    records, _ = records_from_rows(_rows(), H200, "sdxl-1024-cfg", "2026-12-02", "2.13.0", "benchmarks/results/x.json")
    results = tmp_path / "run.json"
    results.write_text(json.dumps({"rows": _rows(), "records": [r.__dict__ for r in records]}))
    shipped = tmp_path / "kernel_records.json"
    shipped.write_text(records_text([]))
    assert kernel_pass_records.main(["--records-from", str(results), "--records-file", str(shipped)]) == 0
    assert load_records(shipped) == tuple(records)
    assert "kernel_records.json: 2 record(s)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--case", "sd99"], "--case: use one of sd15-512-cfg"),
    (["--case", "sdxl-1024-cfg", "--passes", "channels_last_convs"], "--passes: channels_last_convs; Kiln's kernel"),
    (["--case", "sdxl-1024-cfg", "--reps", "500"], "--reps: a whole number from 1 to 100"),
    (["--case", "sdxl-1024-cfg"], "no CUDA device"),
    (["--case", "sdxl-1024-cfg", "--records-from", "x.json"], "give no --case with it"),
    (["--records-from", "/no/such/file.json"], "No such file"),
])
def test_wrong_arguments_are_refused(argv, message, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        kernel_pass_records.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_results_file_with_a_bad_record_is_refused_naming_it(tmp_path, capsys):
    results = tmp_path / "run.json"
    results.write_text(json.dumps({"records": [{"kernel_pass": "fuse_geglu"}]}))
    shipped = tmp_path / "kernel_records.json"
    shipped.write_text(records_text([]))
    with pytest.raises(SystemExit):
        kernel_pass_records.main(["--records-from", str(results), "--records-file", str(shipped)])
    assert "run.json record 0: expected an object with exactly the fields" in capsys.readouterr().err
    assert load_records(shipped) == ()
