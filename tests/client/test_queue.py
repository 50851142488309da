"""`kiln queue` end to end against a stand-in ComfyUI (tests/fake_comfy.py: HTTP and websocket): a prompt
followed to its images and Kiln's compile lines, a sweep and its table, UI-format input, and each error
with its exit status (server down, a node or model the server lacks, a rejected prompt, a failed prompt,
a timeout, the websocket refused)."""
import json
import socket

import pytest

from fake_comfy import API_PROMPT, UI_WORKFLOW, FakeComfy
from kiln.cli import main


@pytest.fixture
def comfy():
    with FakeComfy() as fake:
        yield fake


@pytest.fixture
def workflow(tmp_path):
    path = tmp_path / "txt2img_api.json"
    path.write_text(json.dumps(API_PROMPT))
    return path


def queue(*args) -> int:
    return main(["queue", "--timeout", "30", *map(str, args)])  # a test's own --timeout comes later and wins


def test_a_prompt_runs_and_its_images_are_downloaded(comfy, workflow, tmp_path, capsys):
    out = tmp_path / "images"
    assert queue(workflow, "--server", comfy.url, "--out", out, "--json", tmp_path / "r.json") == 0
    stdout, stderr = capsys.readouterr()
    line, *kiln_lines = stdout.splitlines()
    assert line.startswith("prompt 1/1: queued ") and ", ran " in line
    assert "Kiln compile 1.5s (inductor, dynamic shapes), 1 image(s) -> " in line
    assert line.endswith(str(out / "kiln_00001_.png"))
    assert (out / "kiln_00001_.png").read_bytes() == b"PNG kiln_00001_.png"
    node = "Kiln › Compile UNet (2)"  # each line behind the node that showed it
    assert kiln_lines == [f"  {node}: Kiln compiled graph 0 in 1.5s (inductor, dynamic shapes): first compile at batch 1",
                          f"  {node}: Kiln variant: graph 0 compiled for batch 2, latent 8x8 in 1.5s",
                          f"  {node}: cache miss for graph 0 (no entry), stored a 1.0 MiB entry"]
    # stderr is not a terminal here: plain progress lines, each node as it starts, the sampler's bar when done
    assert "prompt 1/1  KSampler (3)\n" in stderr and "prompt 1/1  KSampler (3)  3/3\n" in stderr
    assert f"prompt 1/1  {node}: Kiln compiled graph 0" in stderr
    (record,) = json.loads((tmp_path / "r.json").read_text())
    assert record["status"] == "ok" and record["kiln_compile_seconds"] == 1.5 and record["run_seconds"] > 0
    assert record["images"] == [str(out / "kiln_00001_.png")] and record["prompt_id"] == comfy.prompts[0][0]


def test_a_sweep_queues_every_combination_and_prints_a_table(comfy, workflow, capsys):
    compiled = "Kiln compiled graph 0 in 2.0s (fx, static shapes): new batch"
    comfy.kiln_text = lambda prompt: None if prompt["3"]["inputs"]["seed"] == 2 else compiled
    assert queue(workflow, "--server", comfy.url, "--sweep", "3.seed=1,2", "--sweep", "5.batch_size=1,2",
                 "--set", "3.steps=2") == 0
    sent = [(p["3"]["inputs"]["seed"], p["5"]["inputs"]["batch_size"], p["3"]["inputs"]["steps"]) for _, p in comfy.prompts]
    assert sent == [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("prompt 1/4 [3.seed=1, 5.batch_size=1]: queued ")
    assert [line for line in lines if line.startswith("prompt 4/4 [3.seed=2, 5.batch_size=2]: ")][0].endswith(
        "Kiln compiled nothing, 2 image(s)")
    table = lines[-6:]
    assert table[0].split() == ["#", "3.seed", "5.batch_size", "queue", "s", "run", "s", "kiln", "compile", "s",
                                "images", "result"]
    assert table[1].split()[:3] == ["1", "1", "1"] and table[1].split()[-3:] == ["2.0", "1", "ok"]
    assert table[4].split()[:3] == ["4", "2", "2"] and table[4].split()[-3:] == ["0.0", "2", "ok"]
    assert table[-1].split()[0] == "total" and table[-1].split()[-4:] == ["4.0", "6", "4", "ok"]
    assert len({len(row) for row in table[1:5]}) == 1  # aligned columns


def test_an_unchanged_prompt_is_said_to_come_from_comfys_cache(comfy, workflow, capsys):
    assert queue(workflow, "--server", comfy.url, "--repeat", "2") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("prompt 2/2")][0].endswith(
        "nothing ran (ComfyUI's cache had every output)")


def test_a_ui_format_workflow_is_converted_with_the_servers_definitions(comfy, tmp_path, capsys):
    path = tmp_path / "ui.json"
    path.write_text(json.dumps(UI_WORKFLOW))
    comfy.kiln_text = lambda prompt: None
    assert queue(path, "--server", comfy.url, "--set", "5.batch_size=2", "--set", "14.value=2") == 0
    (_, sent), = comfy.prompts
    assert sent["5"]["inputs"]["batch_size"] == 2 and sent["14"]["inputs"]["value"] == 2
    assert sent["3"]["inputs"]["model"] == ["4", 0]  # through the bypassed LoRA
    assert "2 image(s)" in capsys.readouterr().out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down(workflow, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert queue(workflow, "--server", url) == 1
    assert f"kiln queue: cannot reach ComfyUI at {url}" in capsys.readouterr().err


def test_a_node_the_server_lacks_stops_before_queueing(comfy, workflow, capsys):
    prompt = json.loads(workflow.read_text())
    prompt["12"] = {"class_type": "FancyUpscaler", "inputs": {"image": ["8", 0]}}
    prompt["4"]["inputs"]["ckpt_name"] = "sd_xl_base_1.0.safetensors"
    workflow.write_text(json.dumps(prompt))
    assert queue(workflow, "--server", comfy.url) == 2
    err = capsys.readouterr().err
    assert "the server has no node 'FancyUpscaler' (node 12): is its node pack installed?" in err
    assert "node 4 (CheckpointLoaderSimple): the server has no model named 'sd_xl_base_1.0.safetensors' in checkpoints" in err
    assert comfy.prompts == []


def test_a_rejected_prompt_shows_the_node_errors(comfy, workflow, capsys):
    comfy.reject = {"error": {"message": "Prompt outputs failed validation", "details": ""},
                    "node_errors": {"3": {"class_type": "KSampler", "errors": [
                        {"message": "Value smaller than min", "details": "steps: 0"}]}}}
    assert queue(workflow, "--server", comfy.url, "--no-check") == 1
    out = capsys.readouterr().out
    assert "prompt 1/1: REJECTED: ComfyUI rejected the prompt: Prompt outputs failed validation" in out
    assert "  node 3 (KSampler): Value smaller than min: steps: 0" in out


def test_a_prompt_that_fails_while_running(comfy, workflow, tmp_path, capsys):
    comfy.fail_on = "8"
    assert queue(workflow, "--server", comfy.url, "--sweep", "3.seed=1,2", "--json", tmp_path / "r.json") == 1
    out = capsys.readouterr().out
    assert out.count("FAILED: prompt ") == 2  # a failed prompt does not stop the sweep
    assert "failed: node 8 (VAEDecode): RuntimeError: boom" in out
    assert "0 ok, 2 failed" in out
    assert [r["status"] for r in json.loads((tmp_path / "r.json").read_text())] == ["failed", "failed"]


def test_a_prompt_that_does_not_finish_in_time(comfy, workflow, capsys):
    comfy.hang = True
    assert queue(workflow, "--server", comfy.url, "--timeout", "0.5", "--sweep", "3.seed=1,2") == 1
    captured = capsys.readouterr()
    assert "prompt 1/2 [3.seed=1]: TIMED OUT: prompt " in captured.out
    assert "did not finish within 0s (it may still be queued or running on the server)" in captured.out
    assert "stopped after prompt 1 of 2" in captured.err and len(comfy.prompts) == 1


def test_a_prompt_whose_end_was_missed_is_found_in_the_history(comfy, workflow, capsys, monkeypatch):
    from kiln.client import follow

    monkeypatch.setattr(follow, "QUIET_SECONDS", 0.3)
    comfy.silent_end = True
    assert queue(workflow, "--server", comfy.url) == 0
    assert "1 image(s)" in capsys.readouterr().out


def test_without_the_websocket_it_polls_and_says_so(comfy, workflow, capsys):
    comfy.websocket = False
    assert queue(workflow, "--server", comfy.url) == 0
    captured = capsys.readouterr()
    assert "cannot open ComfyUI's websocket" in captured.err and "polling /history instead" in captured.err
    assert captured.out.startswith("prompt 1/1: took ") and "Kiln compile not known (no websocket)" in captured.out


@pytest.mark.parametrize("args, message", [
    (["--sweep", "3.seed"], "use NODE.INPUT=V1,V2"),
    (["--set", "77.seed=1"], "node id of the workflow"),
    (["--repeat", "0"], "--repeat 0"),
])
def test_bad_usage_exits_2(comfy, workflow, capsys, args, message):
    assert queue(workflow, "--server", comfy.url, *args) == 2
    assert message in capsys.readouterr().err


def test_a_file_that_is_not_a_workflow(comfy, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("[1, 2]")
    assert queue(path, "--server", comfy.url) == 2
    assert "not a ComfyUI workflow" in capsys.readouterr().err
    path.write_text("{nope")
    assert queue(path, "--server", comfy.url) == 2
    assert "bad.json: Expecting property name" in capsys.readouterr().err


def test_kiln_queue_never_imports_comfyui():
    import subprocess
    import sys

    code = ("import sys, kiln.cli, kiln.client.queue\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('comfy', 'folder_paths', 'comfy_execution', "
            "'server', 'nodes', 'execution')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
