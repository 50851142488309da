"""`kiln warm` against a stand-in ComfyUI HTTP server (standard library, no websocket: the prompts are followed
by polling): what it queues, and its errors."""
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.client.comfy import apply_sets, parse_shapes, with_shape

WORKFLOW = Path(__file__).parents[2] / "workflows" / "api" / "kiln_sd15_cache_api.json"


class FakeComfy(BaseHTTPRequestHandler):
    prompts: list = []
    reject = False
    fail = False

    def log_message(self, *args):
        pass

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.reject:
            return self._answer(400, {"error": {"message": "Prompt outputs failed validation", "details": ""},
                                      "node_errors": {"4": {"class_type": "CheckpointLoaderSimple", "errors": [
                                          {"message": "Value not in list", "details": "ckpt_name: 'x' not in []"}]}}})
        self.prompts.append(body["prompt"])
        self._answer(200, {"prompt_id": f"p{len(self.prompts)}"})

    def do_GET(self):
        prompt_id = self.path.rsplit("/", 1)[-1]
        if self.fail:
            status = {"status_str": "error", "completed": False, "messages": [["execution_error", {
                "node_id": "3", "node_type": "KSampler", "exception_type": "RuntimeError", "exception_message": "boom"}]]}
        else:
            status = {"status_str": "success", "completed": True, "messages": []}
        self._answer(200, {prompt_id: {"status": status, "outputs": {}}})


@pytest.fixture
def server():
    FakeComfy.prompts, FakeComfy.reject, FakeComfy.fail = [], False, False
    httpd = HTTPServer(("127.0.0.1", 0), FakeComfy)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_warm_queues_each_shape_with_one_step_and_previews(server, capsys):
    code = main(["warm", str(WORKFLOW), "--server", server, "--shapes", "1024x1024, 832x1216:2",
                 "--set", "1.ckpt_name=sd_xl_base_1.0.safetensors"])
    assert code == 0, capsys.readouterr().out
    first, second = FakeComfy.prompts
    latent = [n for n in second.values() if n["class_type"] == "EmptyLatentImage"][0]["inputs"]
    assert (latent["width"], latent["height"], latent["batch_size"]) == (832, 1216, 2)
    assert first["1"]["inputs"]["ckpt_name"] == "sd_xl_base_1.0.safetensors"
    assert first["7"]["inputs"]["steps"] == 1
    assert first["9"]["class_type"] == "PreviewImage" and "filename_prefix" not in first["9"]["inputs"]
    out = capsys.readouterr().out
    assert "prompt 2/2 [size=832x1216, batch=2]: took " in out and "2 shapes warmed" in out


def test_a_workflow_without_kilns_cache_is_warmed_with_a_note(server, capsys, tmp_path):
    workflow = json.loads(WORKFLOW.read_text())
    workflow["2"]["inputs"]["cache"] = "off"
    path = tmp_path / "no_cache.json"
    path.write_text(json.dumps(workflow))
    assert main(["warm", str(path), "--server", server, "--shapes", "512x512"]) == 0
    assert "has no Kiln › Cache Graph node" in capsys.readouterr().out
    assert main(["warm", str(WORKFLOW), "--server", server, "--shapes", "512x512"]) == 0
    assert "has no Kiln" not in capsys.readouterr().out


def test_a_rejected_prompt_names_the_node(server, capsys):
    FakeComfy.reject = True
    assert main(["warm", str(WORKFLOW), "--server", server, "--shapes", "512x512"]) == 1
    out = capsys.readouterr().out
    assert "ComfyUI rejected the prompt" in out and "node 4 (CheckpointLoaderSimple): Value not in list" in out


def test_a_failed_prompt_says_where(server, capsys):
    FakeComfy.fail = True
    assert main(["warm", str(WORKFLOW), "--server", server, "--shapes", "512x512"]) == 1
    assert "failed: node 3 (KSampler): RuntimeError: boom" in capsys.readouterr().out


def test_an_unreachable_server(capsys):
    assert main(["warm", str(WORKFLOW), "--server", "http://127.0.0.1:9", "--shapes", "512x512"]) == 1
    assert "cannot reach ComfyUI at http://127.0.0.1:9" in capsys.readouterr().out


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_shapes("512")
    with pytest.raises(ValueError, match="UI-format"):
        with_shape({"nodes": [], "links": []}, 512, 512, 1, 1)
    with pytest.raises(ValueError, match="no EmptyLatentImage"):
        with_shape({"1": {"class_type": "KSampler", "inputs": {}}}, 512, 512, 1, 1)
    with pytest.raises(ValueError, match="node id of the workflow"):
        apply_sets({"1": {"inputs": {}}}, ["7.x=1"])
    assert apply_sets({"1": {"inputs": {}}}, ["1.cfg=7.5", "1.name=abc"])["1"]["inputs"] == {"cfg": 7.5, "name": "abc"}


def test_the_command_line_never_imports_comfyui():
    import subprocess
    import sys

    code = ("import sys, kiln.cli, kiln.client.comfy, kiln.client.warm, kiln.compiler.cache.commands\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('comfy', 'folder_paths', 'comfy_execution')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("content, says", [
    (json.dumps({"1": 5}).encode(), "workflow node 1: must be a JSON object with 'class_type' and 'inputs', not a number"),
    (json.dumps({"1": {"class_type": "EmptyLatentImage"}}).encode(), "workflow node 1: no 'inputs'"),
    (json.dumps({"1": {"class_type": "EmptyLatentImage", "inputs": [64]}}).encode(),
     "workflow node 1: 'inputs' must be a JSON object, not a list"),
    (json.dumps({"nodes": [], "links": []}).encode(), "this is a UI-format workflow: export it with 'Save (API)'"),
    (b"[" * 100000 + b"]" * 100000, "{path}: JSON nested more than 100 levels deep: not a ComfyUI workflow"),
    (b"\xff{}", "{path}: not UTF-8 text (invalid start byte at byte 0)"),
], ids=["node-a-number", "no-inputs", "inputs-a-list", "ui-format", "nested", "not-utf8"])
def test_a_workflow_kiln_cannot_read_is_named_on_stderr(server, capsys, tmp_path, content, says):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main(["warm", str(path), "--server", server, "--shapes", "512x512", "--set", "1.width=64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("kiln warm: " + says.format(path=path)), captured.err
    assert captured.err.count("\n") == 1 and FakeComfy.prompts == []


def test_set_on_a_node_without_inputs_is_named():
    with pytest.raises(ValueError, match="--set '1.x=1': workflow node 1 has no 'inputs' \\(a JSON object\\) to set x in"):
        apply_sets({"1": {"class_type": "KSampler"}}, ["1.x=1"])
    with pytest.raises(ValueError, match="with a node id of the workflow \\(1, 10, 11, .*, 54 and 10 more\\)$"):
        apply_sets({str(n): {"inputs": {}} for n in range(1, 61)}, ["77.x=1"])  # 50 named
