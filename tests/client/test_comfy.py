"""client/comfy.py: the HTTP client's pieces kiln queue relies on (the rest is exercised end to end in
test_queue.py and by kiln warm's tests in tests/cache/test_warm.py)."""
import pytest

from fake_comfy import API_PROMPT, FakeComfy
from kiln.client.comfy import (ComfyClient, PromptFailed, PromptRejected, check_record, output_images,
                               parse_value)


def test_images_are_downloaded_under_their_own_name_only(tmp_path):
    with FakeComfy() as comfy:
        client = ComfyClient(comfy.url)
        path = client.download({"filename": "../../escape.png", "subfolder": "", "type": "output"}, tmp_path)
        assert path == tmp_path / "escape.png" and path.read_bytes() == b"PNG ../../escape.png"
        client.cancel("abc")
        assert comfy.cancelled == [("/queue", {"delete": ["abc"]}), ("/interrupt", {"prompt_id": "abc"})]
        comfy.reject = {"error": {"message": "Prompt has no outputs", "details": ""}, "node_errors": {}}
        with pytest.raises(PromptRejected, match="ComfyUI rejected the prompt: Prompt has no outputs"):
            client.submit(API_PROMPT)


def test_websocket_url_follows_the_server_address():
    client = ComfyClient("https://comfy.example:8443/base/")
    assert client.websocket_url() == f"wss://comfy.example:8443/base/ws?clientId={client.client_id}"
    assert ComfyClient("http://127.0.0.1:8188").websocket_url().startswith("ws://127.0.0.1:8188/ws?clientId=")


def test_history_records():
    record = {"outputs": {"12": {"images": [{"filename": "c.png"}]}, "9": {"images": [{"filename": "a.png"},
                                                                                  {"filename": "b.png"}]},
                          "10": {"text": ["not an image"]}}, "status": {"status_str": "success", "completed": True}}
    assert [i["filename"] for i in output_images(record)] == ["a.png", "b.png", "c.png"]
    assert check_record("p1", record) is record
    failed = {"status": {"status_str": "error", "completed": False, "messages": [
        ["execution_start", {}], ["execution_interrupted", {"node_id": "3", "node_type": "KSampler"}]]}}
    with pytest.raises(PromptFailed, match="prompt p1 failed: interrupted on the server at node 3 \\(KSampler\\)"):
        check_record("p1", failed)


def test_command_line_values():
    assert [parse_value(v) for v in ("7", "7.5", "true", '"7"', "euler", "[1, 2]")] == [7, 7.5, True, "7", "euler", [1, 2]]
