"""`kiln bench --cache`: the runs it makes (each a fresh process, with the right Inductor cache
directory) and the targets it reports. The processes are stood in for: a real run compiles the
model four times (minutes; benchmarks/results/cpu-cache-* holds one)."""
import argparse

from kiln.benchmarks import cache_bench


def args(**overrides):
    base = dict(model="sd15", size="tiny", device="cpu", dtype="fp32", batch=2, modes=None, json=None)
    base.update(overrides)
    return argparse.Namespace(**base)


def test_each_warm_start_keeps_its_cold_runs_inductor_folders_and_kiln_and_torch_compile_have_their_own(monkeypatch,
                                                                                                       capsys):
    seen = []
    times = {"kiln cold": 100.0, "kiln warm": 8.0, "torch.compile cold": 60.0, "torch.compile warm": 9.0}

    def fake_child(a, run, cache_dir, inductor_dir, temp_dir, log):
        seen.append((run, cache_dir, inductor_dir, temp_dir))
        return {"run": run, "first_step_s": times[run], "inductor": {}, "checksum": 1.5, "process_s": 1.0}

    monkeypatch.setattr(cache_bench, "_run_child", fake_child)
    assert cache_bench.main(args()) == 0
    assert [run for run, _, _, _ in seen] == list(cache_bench.RUNS)
    for column in (2, 3):  # Inductor's cache directory; the temporary folder, where its headers live
        dirs = {row[0]: row[column] for row in seen}
        assert dirs["torch.compile cold"] == dirs["torch.compile warm"] and dirs["kiln cold"] == dirs["kiln warm"]
        assert dirs["kiln cold"] != dirs["torch.compile cold"]
    assert len({cache for _, cache, _, _ in seen}) == 1
    out = capsys.readouterr().out
    assert "Kiln warm start: 8.0% of its cold compile (target <= 10%: met)" in out
    assert "0.89x torch.compile's warm start (target < 1: met)" in out


def test_missed_targets_and_failed_runs_are_said(monkeypatch, capsys):
    def fake_child(a, run, cache_dir, inductor_dir, temp_dir, log):
        if run == "torch.compile warm":
            return {"run": run, "error": "RuntimeError: boom", "process_s": 1.0}
        return {"run": run, "first_step_s": 50.0, "inductor": {}, "checksum": 1.0, "process_s": 1.0}

    monkeypatch.setattr(cache_bench, "_run_child", fake_child)
    assert cache_bench.main(args()) == 1
    assert "torch.compile warm   FAILED: RuntimeError: boom" in capsys.readouterr().out
    result = {"rows": [], "summary": {"kiln_warm_vs_cold": 0.5, "kiln_warm_vs_torch_compile_warm": 2.0,
                                      "target_warm_at_most_10pct_of_cold": False,
                                      "target_faster_than_torch_compile_warm": False, "same_output_cold_warm": True,
                                      "target_warm_under_10s": False}}
    table = cache_bench.format_table(result)
    assert "NOT met" in table and "GPU target, warm start under 10s: NOT met" in table


def test_kiln_bench_cache_runs_it(monkeypatch):
    from kiln.cli import main

    called = []
    monkeypatch.setattr(cache_bench, "main", lambda a: called.append((a.model, a.size)) or 0)
    assert main(["bench", "--cache", "--size", "tiny"]) == 0 and called == [("sd15", "tiny")]


def test_a_child_runs_with_its_inductor_dir_and_temporary_folder(monkeypatch, tmp_path):
    import json
    import subprocess

    ran = []

    def fake_run(command, env, **kwargs):
        ran.append(env)
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps({"run": "kiln warm", "first_step_s": 1.0}))

    monkeypatch.setattr(cache_bench.subprocess, "run", fake_run)
    a = args(cache_mode="balanced")
    cache_bench._run_child(a, "kiln warm", str(tmp_path / "c"), str(tmp_path / "i"), str(tmp_path / "t"),
                           lambda _: None)
    (env,) = ran
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "i") and env["TMPDIR"] == str(tmp_path / "t")
    assert (tmp_path / "t").is_dir()  # made for it: a TMPDIR that does not exist is ignored
