"""`kiln bench --prompts` (benchmarks/prompts_bench.py): the runs it makes, each a fresh process with
caches of its own, the ratios it reports, and one child run in this process. The compiling children
are stood in for: a real run compiles the model twice (minutes; benchmarks/results/cpu-prompts-*
holds one)."""
import argparse
import json
import math
import subprocess

import pytest

from kiln.benchmarks import prompts_bench


def args(**overrides):
    base = dict(model="sd15", size="tiny", device="cpu", dtype="fp32", batch=2, modes=None, json=None,
                prompt_count=3, prompt_steps=2, idle=0.0)
    base.update(overrides)
    return argparse.Namespace(**base)


def row(run, seconds, waiting=None, checksum=100.0):
    prompts = [{"seconds": s, "steps": [s / 2, s / 2]} for s in seconds]
    if waiting is not None:
        for prompt, n in zip(prompts, waiting):
            prompt["regions_waiting"] = n
    return {"run": run, "prompts": prompts, "checksum": checksum}


def test_each_run_is_its_own_process_with_caches_of_its_own_and_the_ratios_are_said(monkeypatch, capsys, tmp_path):
    rows = {"eager": row("eager", [10.0, 10.0, 10.0]),
            "kiln": row("kiln", [40.0, 8.0, 8.0], checksum=100.001),
            "kiln background": row("kiln background", [12.0, 11.0, 8.0], waiting=[3, 0, 0])}
    seen = []

    def fake_child(a, run, work, log):
        seen.append((run, work))
        return rows[run]

    monkeypatch.setattr(prompts_bench, "_run_child", fake_child)
    path = tmp_path / "prompts.json"
    assert prompts_bench.main(args(json=str(path))) == 0
    assert [run for run, _ in seen] == list(prompts_bench.RUNS)
    out = capsys.readouterr().out
    assert ("first prompt: background 0.30x Kiln's in the foreground, 1.20x eager's (Kiln in the foreground 4.00x "
            "eager's); all 3 prompts: background 0.55x the foreground's; every region ready after prompt 2") in out
    assert "kiln background     12.00s    11.00s     8.00s       4000.0 ms   3 0 0" in out
    result = json.loads(path.read_text())
    assert result["summary"]["result_difference_vs_eager"]["kiln"] == pytest.approx(1e-5)
    assert result["prompts"] == 3 and result["steps"] == 2


def test_a_failed_run_is_said_and_the_bench_fails(monkeypatch, capsys):
    def fake_child(a, run, work, log):
        if run == "kiln background":
            return {"run": run, "error": "terminate called without an active exception"}
        return row(run, [1.0, 1.0, 1.0])

    monkeypatch.setattr(prompts_bench, "_run_child", fake_child)
    assert prompts_bench.main(args()) == 1
    assert "kiln background  FAILED: terminate called without an active exception" in capsys.readouterr().out


def test_regions_never_ready_are_said():
    rows = [row("eager", [1.0]), row("kiln", [5.0]), row("kiln background", [1.5], waiting=[2])]
    result = {"prompts": 1, "rows": rows, "summary": prompts_bench.summarize(rows)}
    assert "every region ready after none of the 1 prompts" in prompts_bench.format_table(result)


def test_a_child_gets_an_empty_kiln_cache_inductor_dir_and_temporary_folder_of_its_own(monkeypatch, tmp_path):
    ran = []

    def fake_run(command, env, **kwargs):
        ran.append((command, env))
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(row("kiln", [1.0])))

    monkeypatch.setattr(prompts_bench.subprocess, "run", fake_run)
    for run in ("kiln", "kiln background"):
        prompts_bench._run_child(args(kiln_mode="balanced"), run, str(tmp_path), lambda _: None)
    (first, first_env), (second, second_env) = ran
    cache_of = [command[command.index("--cache-dir") + 1] for command in (first, second)]
    assert len(set(cache_of)) == 2 and all(path.startswith(str(tmp_path)) for path in cache_of)
    for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert first_env[name] != second_env[name] and first_env[name].startswith(str(tmp_path))
    assert (tmp_path / "kiln-background" / "temp").is_dir()  # made for it: a TMPDIR that does not exist is ignored
    assert first[first.index("--prompts") + 1] == "3" and first[first.index("--idle") + 1] == "0.0"


def test_an_eager_child_runs_its_prompts_in_this_process():
    result = prompts_bench.child(argparse.Namespace(run="eager", model="sd15", size="tiny", device="cpu",
                                                    dtype="fp32", batch=2, prompts=2, steps=3, idle=0.0, mode="balanced",
                                                    cache_dir=""))
    assert [len(p["steps"]) for p in result["prompts"]] == [3, 3] and math.isfinite(result["checksum"])
    assert all(p["seconds"] >= sum(p["steps"]) * 0.99 for p in result["prompts"])


def test_the_latent_is_a_unet_s_first_argument_and_a_dit_s_hidden_states():
    import torch

    x = torch.zeros(1)
    assert prompts_bench._latent_of((x, x), {}) == ("arg", 0)
    assert prompts_bench._latent_of((), {"hidden_states": x, "timestep": x}) == ("kw", "hidden_states")
    with pytest.raises(ValueError, match="no latent"):
        prompts_bench._latent_of((), {"timestep": 1.0})
    assert prompts_bench._with_latent((), {"hidden_states": x}, ("kw", "hidden_states"), x + 1)[1]["hidden_states"] == 1


def test_kiln_bench_prompts_runs_it_and_refuses_an_empty_run(monkeypatch):
    from kiln.cli import main

    called = []
    monkeypatch.setattr(prompts_bench, "main", lambda a: called.append((a.prompt_count, a.prompt_steps, a.idle)) or 0)
    assert main(["bench", "--prompts", "--prompt-count", "2", "--idle", "1.5"]) == 0 and called == [(2, 8, 1.5)]
    for bad in (["--prompt-count", "0"], ["--prompt-steps", "-1"], ["--idle", "-1"], ["--idle", "nan"]):
        with pytest.raises(SystemExit):
            main(["bench", "--prompts", *bad])
