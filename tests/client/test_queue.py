"""`kiln queue` end to end against a stand-in ComfyUI (tests/fake_comfy.py: HTTP and websocket): a prompt
followed to its images and Kiln's compile lines, a sweep and its table, UI-format input, and each error
with its exit status (server down, a node or model the server lacks, a rejected prompt, a failed prompt,
a timeout, the websocket refused); and a broken or hostile server: every odd answer (cut short, not
UTF-8, not JSON, the wrong shape, an image name that is no file name, a websocket message that is not
JSON) ends it with exit status 1 and one line on stderr saying what the server sent, no traceback; a
websocket that breaks the protocol is left for polling /history."""
import json
import socket

import pytest

from fake_comfy import API_PROMPT, UI_WORKFLOW, FakeComfy, http_answer
from kiln.cli import main
from kiln.client.comfy import shown
from kiln.client.websocket import CONTINUATION, TEXT, encode_frame
from kiln.events import CompileEvent


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
    compiled = CompileEvent(0, 2.0, "fx", False, "new batch")
    comfy.kiln_text = lambda prompt: None if prompt["3"]["inputs"]["seed"] == 2 else [compiled]
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



# -- a broken or hostile server

def the_server_sent(capsys) -> str:
    """kiln queue's one line on stderr besides the progress lines: what the server sent. No traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("prompt 1/1  ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("kiln queue: the server sent "), err
    return lines[0]


def json_answer(value) -> bytes:
    return http_answer(json.dumps(value).encode())


CUT_CHUNK = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100\r\n{\"KSampler\": "  # 256 bytes announced


@pytest.mark.parametrize("endpoint, answer, says", [
    ("/object_info", http_answer(b'{"KSampler": {"input"', length=1000),
     "/object_info's answer cut short (21 bytes of the 1000 it announced)"),
    ("/object_info", CUT_CHUNK, "/object_info's answer cut short (IncompleteRead: "),
    ("/object_info", http_answer(b'{"KSampler": "\xff\xfe"}'),
     "/object_info's answer in an encoding that is not UTF-8 (invalid start byte at byte 14): b'{\"KSampler\""),
    ("/object_info", http_answer(b"<html>hello</html>", content_type="text/html"),
     "/object_info's answer not as JSON (JSONDecodeError: 'Expecting value: line 1 column 1 (char 0)'): "
     "'<html>hello</html>': is http://127.0.0.1:"),
    ("/object_info", http_answer(b"[" * 100000 + b"]" * 100000), "/object_info's answer not as JSON (RecursionError: "),
    ("/object_info", json_answer([1, 2]), "/object_info's answer as a list, not a JSON object: [1, 2]"),
    ("/object_info", json_answer({"KSampler": ["x"]}), "node 'KSampler' in /object_info's answer as a list"),
    ("/object_info", json_answer({"KSampler": {"input": {"required": {"seed": "INT"}}}}),
     "input 'seed' of node 'KSampler' in /object_info's answer as 'INT', not a list [type or options, ...]"),
    ("/object_info", json_answer({"KSampler": {"input_order": {"required": "seed"}}}),
     "input_order 'required' of node 'KSampler' in /object_info's answer as a string, not a list"),
    ("/object_info", json_answer({"KSampler": {"output": {"LATENT": 0}}}),
     "'output' in node 'KSampler' in /object_info's answer as a JSON object, not a list"),
    ("/prompt", json_answer(["p1"]), "/prompt's answer as a list, not a JSON object: ['p1']"),
    ("/prompt", json_answer({"number": 1, "node_errors": {}}),
     "/prompt's answer without a prompt_id: {'node_errors': {}, 'number': 1}"),
    ("/prompt", json_answer({"prompt_id": 7}), "a prompt_id that is not a short line of text in /prompt's answer: 7"),
    ("/prompt", json_answer({"prompt_id": "p1\x1b[2J"}), "a prompt_id that is not a short line of text"),
    ("/prompt", b"HELLO\r\n\r\n", "no HTTP answer to /prompt (BadStatusLine: "),
    ("/prompt", b"", "no HTTP answer to /prompt (RemoteDisconnected: 'Remote end closed connection without response')"),
    ("/prompt", http_answer(b"[1]", status="400 Bad Request"), "/prompt's rejection as a list, not a JSON object"),
    ("/history", json_answer([]), "/history/"),
], ids=["object_info-cut-short", "object_info-chunk-cut-short", "object_info-not-utf8", "object_info-html",
        "object_info-nested-too-deep", "object_info-a-list", "object_info-node-a-list", "object_info-spec-a-string",
        "object_info-input_order-a-string", "object_info-output-an-object", "prompt-a-list", "prompt-no-prompt_id",
        "prompt-prompt_id-a-number", "prompt-prompt_id-escape-codes", "prompt-not-http", "prompt-no-answer",
        "prompt-rejection-a-list", "history-a-list"])
def test_an_odd_http_answer_ends_it_with_one_line(comfy, workflow, capsys, endpoint, answer, says):
    comfy.answers[endpoint] = answer
    assert queue(workflow, "--server", comfy.url) == 1
    line = the_server_sent(capsys)
    assert line.startswith(f"kiln queue: the server sent {says}"), line
    if endpoint == "/history":
        assert line.endswith("'s answer as a list, not a JSON object: []") and comfy.prompts[0][0] in line


@pytest.mark.parametrize("edit, says", [
    (lambda record: ["done"], "/history/ID's record as a list, not a JSON object: ['done']"),
    (lambda record: {**record, "status": "success"}, "'status' in /history/ID's record as a string, not a JSON object"),
    (lambda record: {**record, "outputs": ["9"]}, "'outputs' in /history/ID's record as a list"),
    (lambda record: {**record, "outputs": {"9": {"images": "kiln.png"}}},
     "'images' in the output of node '9' in /history/ID's record as a string, not a list"),
    (lambda record: {**record, "outputs": {"9": {"images": [{"filename": "a.png", "subfolder": ["x"]}]}}},
     "'subfolder' in an image in the output of node '9' in /history/ID's record as a list, not a string"),
    (lambda record: {**record, "status": {**record["status"], "messages": [["execution_start"]]}},
     "a status message that is not [kind, {...}] in /history/ID's record: ['execution_start']"),
], ids=["record-a-list", "status-a-string", "outputs-a-list", "images-a-string", "subfolder-a-list", "message-no-pair"])
def test_an_odd_history_record_ends_it_with_one_line(comfy, workflow, capsys, edit, says):
    comfy.edit_record = edit
    assert queue(workflow, "--server", comfy.url) == 1
    line = the_server_sent(capsys)
    assert line.startswith("kiln queue: the server sent " + says.replace("ID", comfy.prompts[0][0])), line


@pytest.mark.parametrize("name", ["..", "", ".", "images/..", "images/", "a\\..\\b.png", "a\x00b.png", "\x1b[2J.png",
                                  "k" * 201 + ".png", 5],
                         ids=["dotdot", "empty", "dot", "ends-in-dotdot", "ends-in-slash", "backslashes", "nul",
                              "escape", "too-long", "a-number"])
def test_an_image_name_that_is_no_file_name_ends_it_with_one_line(comfy, workflow, tmp_path, capsys, name):
    out = tmp_path / "out" / "images"
    comfy.edit_record = lambda record: {**record, "outputs": {"9": {"images": [
        {"filename": name, "subfolder": "", "type": "output"}]}}}
    assert queue(workflow, "--server", comfy.url, "--out", out) == 1
    line = the_server_sent(capsys)
    if isinstance(name, str):
        assert line == (f"kiln queue: the server sent an image named {shown(name)} in the output of node '9' in "
                        f"/history/{comfy.prompts[0][0]}'s record: not a file name kiln can save an image under")
    else:
        assert "an image's filename in the output of node '9'" in line and "as a number, not a string: 5" in line
    assert list((tmp_path / "out").rglob("*")) == [out]  # nothing written, in the folder or above it


@pytest.mark.parametrize("text, says", [
    (b"{nope", "a websocket message that is not JSON (JSONDecodeError: "),
    (b"[1, 2]", "a websocket message as a list, not a JSON object: [1, 2]"),
    (b'{"type": "status", "data": "idle"}', "'data' in a websocket message of type 'status' as a string, not a JSON "
                                           "object: 'idle'"),
], ids=["not-json", "a-list", "data-a-string"])
def test_a_websocket_message_that_is_no_json_object_ends_it_with_one_line(comfy, workflow, capsys, text, says):
    comfy.ws_frames = [encode_frame(TEXT, text, mask=False)]
    assert queue(workflow, "--server", comfy.url) == 1
    assert the_server_sent(capsys).startswith("kiln queue: the server sent " + says)


@pytest.mark.parametrize("frames, says", [
    ([encode_frame(TEXT, b'{"type": "\xff"}', mask=False)],
     "the server sent a websocket text message that is not UTF-8 (invalid start byte at byte 10 of 13)"),
    ([encode_frame(TEXT, b"a" * 600, mask=False, fin=False), encode_frame(CONTINUATION, b"b" * 600, mask=False)],
     "a websocket message of 1200 bytes or more (the most kiln takes is 1000): the stream is broken"),
], ids=["text-not-utf8", "fragments-past-the-cap"])
def test_a_websocket_that_breaks_the_protocol_is_left_for_polling(comfy, workflow, capsys, monkeypatch, frames, says):
    from kiln.client import websocket

    monkeypatch.setattr(websocket, "MAX_MESSAGE_BYTES", 1000)
    comfy.ws_frames = frames
    assert queue(workflow, "--server", comfy.url) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line == (f"kiln queue: the websocket broke ({says}): following the prompts by polling /history from "
                    "here (no progress, no Kiln compile lines, total times only)")
    assert captured.out.startswith("prompt 1/1: took ") and "1 image(s)" in captured.out


@pytest.mark.parametrize("server, why", [("127.0.0.1:8188", "it does not start with http:// or https://"),
                                         ("http://127.0.0.1:port", "nonnumeric port")])
def test_a_server_address_that_is_not_one(workflow, capsys, server, why):
    assert queue(workflow, "--server", server) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kiln queue: {server!r} is not a server address such as http://127.0.0.1:8188 ({why}")


# -- a hostile workflow: refused before anything is queued, naming the node and field

@pytest.mark.parametrize("edit, args, says", [
    (lambda w: w["3"].__setitem__("inputs", [1]), [], "workflow node 3: 'inputs' must be a JSON object, not a list"),
    (lambda w: w["3"].__setitem__("class_type", ["KSampler"]), [], "workflow node 3: 'class_type' must be a node's "
                                                                   "name, not ['KSampler']"),
    (lambda w: w["3"].__setitem__("_meta", "oops"), [], "workflow node 3: '_meta' must be a JSON object, not a string"),
    (lambda w: w.__setitem__("10", 5), ["--no-check"], "workflow node 10: must be a JSON object with 'class_type' and "
                                                       "'inputs', not a number (is this an API-format workflow?)"),
    (lambda w: w["9"].pop("inputs"), ["--set", "9.filename_prefix=x"], "workflow node 9: no 'inputs'"),
    (lambda w: w.clear() or w.update({"nodes": [{"type": "KSampler"}], "links": []}), [],
     "workflow 'nodes' entry 0: no 'id'"),
    (lambda w: w.clear() or w.update({"nodes": [7], "links": []}), ["--no-check"],
     "workflow 'nodes' entry 0: must be a JSON object (a node), not a number: 7"),
    (lambda w: w.clear() or w.update(json.loads(json.dumps(UI_WORKFLOW))) or w["links"].__setitem__(0, [1]), [],
     "workflow 'links' entry 0: must be [id, origin node, origin slot, target node, target slot, type] or a JSON "
     "object, not [1]"),
], ids=["inputs-a-list", "class_type-a-list", "meta-a-string", "no-check-node-a-number", "set-without-inputs",
        "ui-node-without-id", "ui-node-a-number", "ui-link-too-short"])
def test_a_workflow_of_the_wrong_shape_stops_before_queueing(comfy, workflow, capsys, edit, args, says):
    prompt = json.loads(workflow.read_text())
    edit(prompt)
    workflow.write_text(json.dumps(prompt))
    assert queue(workflow, "--server", comfy.url, *args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kiln queue: {says}") and captured.err.count("\n") == 1, captured.err
    assert captured.out == "" and comfy.prompts == []


@pytest.mark.parametrize("command", ["queue", "warm"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "soon"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(workflow, capsys, command, value):
    shapes = ["--shapes", "64x64"] if command == "warm" else []
    with pytest.raises(SystemExit) as exit_:
        main([command, str(workflow), *shapes, f"--timeout={value}"])
    assert exit_.value.code == 2
    assert f"argument --timeout: {value!r} is not a number of seconds above 0" in capsys.readouterr().err


def test_images_past_the_cap_are_counted_not_downloaded_and_the_exit_status_says_so(comfy, workflow, tmp_path, capsys,
                                                                                    monkeypatch):
    from kiln.client import queue as queue_module

    monkeypatch.setattr(queue_module, "MAX_IMAGES_PER_PROMPT", 2)
    comfy.edit_record = lambda record: {**record, "outputs": {"9": {"images": [
        {"filename": f"img{i}.png", "subfolder": "", "type": "output"} for i in range(5)]}}}
    out = tmp_path / "images"
    assert queue(workflow, "--server", comfy.url, "--out", out, "--json", tmp_path / "r.json") == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert sorted(p.name for p in out.iterdir()) == ["img0.png", "img1.png"]
    assert line.endswith(f"2 image(s) -> {out / 'img0.png'}, {out / 'img1.png'}, 3 more image(s) NOT downloaded "
                         "(kiln queue downloads at most 2 per prompt)")
    (record,) = json.loads((tmp_path / "r.json").read_text())
    assert record["status"] == "ok" and record["images_not_downloaded"] == 3


def test_what_the_server_sent_past_the_cap_is_said_once_after_the_prompt(comfy, workflow, tmp_path, capsys):
    from kiln.client.follow import KILN_LINES_LEFT_OUT, MAX_KEPT

    comfy.kiln_text = lambda prompt: [f"line {n}" for n in range(MAX_KEPT + 3)]
    assert queue(workflow, "--server", comfy.url, "--json", tmp_path / "r.json") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[MAX_KEPT] == "  Kiln › Compile UNet (2): line 999"
    assert out[MAX_KEPT + 1:] == [f"  left out: 3 {KILN_LINES_LEFT_OUT}"]
    (record,) = json.loads((tmp_path / "r.json").read_text())
    assert len(record["kiln_lines"]) == MAX_KEPT and record["left_out"] == {KILN_LINES_LEFT_OUT: 3}


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1e300])
def test_a_compile_time_that_is_no_time_ends_it_with_one_line(comfy, workflow, tmp_path, capsys, seconds):
    comfy.kiln_text = lambda prompt: [CompileEvent(0, seconds, "inductor", True, "first")]
    assert queue(workflow, "--server", comfy.url, "--json", tmp_path / "r.json") == 1
    line = the_server_sent(capsys)
    assert line.startswith(f"kiln queue: the server sent a Kiln compile event whose 'seconds' is {seconds!r}, not a "
                           "time from 0 to 1e+06 seconds")
    assert not (tmp_path / "r.json").exists()  # no record with a time that is no number


@pytest.mark.parametrize("content, says", [(b"[" * 100000 + b"]" * 100000, "JSON nested more than 100 levels deep"),
                                           (b"\xff{}", "not UTF-8 text (invalid start byte at byte 0)")],
                         ids=["nested", "not-utf8"])
def test_a_workflow_file_that_cannot_be_read_is_named(comfy, workflow, capsys, content, says):
    workflow.write_bytes(content)
    assert queue(workflow, "--server", comfy.url) == 2
    assert capsys.readouterr().err == f"kiln queue: {workflow}: {says}" + (
        ": not a ComfyUI workflow\n" if "nested" in says else "\n")
