"""client/comfy.py: the HTTP client's pieces kiln queue relies on (the rest is exercised end to end in
test_queue.py and by kiln warm's tests in tests/cache/test_warm.py); images saved into --out never
overwrite a file or follow a link, and a broken download leaves nothing behind; kiln warm says what an
odd server sent; a rejection reaches the terminal cut short and without control characters; a server
that answers a byte now and then (HTTP or HTTPS: head, body, chunk sizes) is too slow past the timeout."""
import json
import os
import sysconfig
import time
from pathlib import Path

import pytest

from fake_comfy import API_PROMPT, FakeComfy, http_answer
from kiln.cli import main
from kiln.client import comfy as comfy_module
from kiln.client.comfy import (ComfyClient, ComfyError, PromptFailed, PromptRejected, ServerAnswerError, check_record,
                               output_images, parse_value)

IMAGE = {"filename": "kiln_00001_.png", "subfolder": "", "type": "output"}


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


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links here")
def test_a_link_named_like_the_image_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(b"keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "kiln_00001_.png").symlink_to(target)
    (out / "kiln_00001_-1.png").symlink_to(tmp_path / "elsewhere" / "missing.png")  # a dangling one too
    with FakeComfy() as fake:
        path = ComfyClient(fake.url).download(IMAGE, out)
    assert path == out / "kiln_00001_-2.png" and path.read_bytes() == b"PNG kiln_00001_.png"
    assert target.read_bytes() == b"keep me" and os.readlink(out / "kiln_00001_.png") == str(target)
    assert not (tmp_path / "elsewhere" / "missing.png").exists()


def test_a_file_named_like_the_image_is_not_overwritten(tmp_path):
    (tmp_path / "kiln_00001_.png").write_bytes(b"mine")
    with FakeComfy() as fake:
        client = ComfyClient(fake.url)
        paths = [client.download(IMAGE, tmp_path) for _ in range(2)]
    assert paths == [tmp_path / "kiln_00001_-1.png", tmp_path / "kiln_00001_-2.png"]
    assert (tmp_path / "kiln_00001_.png").read_bytes() == b"mine"
    assert all(path.read_bytes() == b"PNG kiln_00001_.png" for path in paths)


def test_numbered_names_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(comfy_module, "MAX_NAME_TRIES", 3)
    for name in ("a.png", "a-1.png", "a-2.png"):
        (tmp_path / name).write_bytes(b"mine")
    with FakeComfy() as fake, pytest.raises(ComfyError, match="cannot save image a.png in .*: a.png and a-1.png to "
                                                              "a-2.png are all taken"):
        ComfyClient(fake.url).download({"filename": "a.png"}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1.png", "a-2.png", "a.png"]


@pytest.mark.parametrize("answer, says", [
    (http_answer(b"PNG half", length=100, content_type="image/png"),
     "cut short \\(8 bytes of the 100 it announced\\)"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nPNG", "cut short \\(IncompleteRead: "),
], ids=["content-length", "chunked"])
def test_a_download_cut_short_leaves_no_file(tmp_path, answer, says):
    with FakeComfy() as fake:
        fake.answers["/view"] = answer
        with pytest.raises(ServerAnswerError, match="^the server sent /view's answer " + says):
            ComfyClient(fake.url).download(IMAGE, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_download_longer_than_the_limit_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(comfy_module, "MAX_IMAGE_BYTES", 3 * 2**20)
    with FakeComfy() as fake:
        fake.answers["/view"] = http_answer(b"\0" * (4 * 2**20), content_type="image/png")
        with pytest.raises(ServerAnswerError, match="^the server sent /view an answer of more than 3145728 bytes"):
            ComfyClient(fake.url).download(IMAGE, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_http_error_is_one_line():
    with FakeComfy() as fake:
        fake.answers["/object_info"] = http_answer(b"Traceback (most recent call last):\n  boom\n", "500 Oops")
        with pytest.raises(ComfyError) as error:
            ComfyClient(fake.url).object_info()
    assert str(error.value) == (f"{fake.url}/object_info: HTTP 500: 'Traceback (most recent call last):\\n  boom\\n'")


@pytest.mark.parametrize("rejection, says", [
    ({"error": "no prompt", "node_errors": {}}, None),
    ({"error": {"message": "bad"}, "node_errors": []}, "'node_errors' in /prompt's rejection as a list"),
    ({"error": {"message": "bad"}, "node_errors": {"3": {"errors": ["too small"]}}},
     "an error of node '3' in /prompt's rejection as a string, not a JSON object: 'too small'"),
], ids=["error-as-text", "node_errors-a-list", "an-error-a-string"])
def test_a_rejection_is_read_for_its_shape(rejection, says):
    with FakeComfy() as fake:
        fake.reject = rejection
        if says is None:
            with pytest.raises(PromptRejected, match="^ComfyUI rejected the prompt: no prompt$"):
                ComfyClient(fake.url).submit(API_PROMPT)
        else:
            with pytest.raises(ServerAnswerError, match="^the server sent " + says):
                ComfyClient(fake.url).submit(API_PROMPT)


def test_kiln_warm_says_what_the_server_sent(tmp_path, capsys):
    path = tmp_path / "api.json"
    path.write_text(json.dumps(API_PROMPT))
    with FakeComfy() as fake:
        fake.answers["/history"] = http_answer(b'{"oops": ')
        assert main(["warm", str(path), "--server", fake.url, "--shapes", "64x64"]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].startswith("kiln warm: the server sent /history/") and "Traceback" not in (
        captured.out + captured.err)
    assert "'s answer not as JSON (JSONDecodeError: " in captured.err


def test_a_prompt_error_from_the_server_reaches_the_terminal_line_by_line_without_control_characters():
    from kiln.client.comfy import execution_error_text

    data = {"node_id": "9", "node_type": "KSampler\x1b[2J", "exception_type": "RuntimeError",
            "exception_message": "boom\x1b]0;x\x07\nsecond line\n" + "more\n" * 100}
    text = execution_error_text("execution_error", data)
    assert text.startswith("node 9 (KSampler?[2J): RuntimeError: boom?]0;x?\nsecond line\nmore")
    assert text.count("\n") == 40 and "\x1b" not in text and text.endswith("\nmore\n... and 62 more line(s)")
    assert execution_error_text("execution_interrupted", {"node_id": "9", "node_type": "KSampler"}) == \
        "interrupted on the server at node 9 (KSampler)"


def test_a_null_subfolder_or_type_is_sent_as_the_servers_default(tmp_path, monkeypatch):
    from kiln.client.comfy import history_record

    record = history_record({"outputs": {"9": {"images": [{"filename": "a.png", "subfolder": None, "type": None}]}}}, "r")
    asked = []
    real_open = ComfyClient._open
    monkeypatch.setattr(ComfyClient, "_open", lambda self, path, body=None: asked.append(path) or real_open(self, path, body))
    with FakeComfy() as fake:
        path = ComfyClient(fake.url).download(output_images(record)[0], tmp_path)
    assert asked == ["/view?filename=a.png&subfolder=&type=output"] and path.read_bytes() == b"PNG a.png"


def test_a_rejection_reaches_the_terminal_cut_and_without_control_characters():
    from kiln.client.comfy import MAX_ERROR_FIELD, MAX_ERROR_LINES

    errors = {str(n): {"class_type": "KSampler\x1b[31m", "errors": [{"message": "m\x1b[2J", "details": "x" * 100000}]}
              for n in range(MAX_ERROR_LINES + 5)}
    with FakeComfy() as fake:
        fake.reject = {"error": "bad\x1b]0;pwned\x07", "node_errors": errors}
        with pytest.raises(PromptRejected) as caught:
            ComfyClient(fake.url).submit(API_PROMPT)
        fake.answers["/prompt"] = http_answer(b"Bad\x1b[2J" + b"y" * 100000, status="400 Bad Request")
        with pytest.raises(PromptRejected) as not_json:
            ComfyClient(fake.url).submit(API_PROMPT)
    first, *nodes, more = str(caught.value).splitlines()
    assert first == "ComfyUI rejected the prompt: bad?]0;pwned?" and len(nodes) == MAX_ERROR_LINES
    assert nodes[0] == "  node 0 (KSampler?[31m): m?[2J: " + "x" * (MAX_ERROR_FIELD - 3) + "..."
    assert more == "  ... and 5 more node error(s) not shown"
    assert str(not_json.value) == "ComfyUI rejected the prompt: Bad?[2J" + "y" * (MAX_ERROR_FIELD - 3 - 7) + "..."


# -- a server that answers a byte now and then: every request has a deadline, the client's timeout

def trickling_server(head: bytes, tls: "ssl.SSLContext | None" = None) -> int:
    """A server for one connection: it reads the request, sends `head`, then a space every 20 ms until
    the client hangs up. Its port."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        connection, _ = listener.accept()
        listener.close()
        try:
            if tls:
                connection = tls.wrap_socket(connection, server_side=True)
            with connection:
                connection.recv(65536)
                connection.sendall(head)
                for _ in range(500):  # 10 s at most, whatever the client does
                    connection.sendall(b" ")
                    time.sleep(0.02)
        except OSError:
            pass  # the client gave up: what this server is for

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


SLOW_ANSWERS = {
    "head": b"HTTP/1.1 200 OK\r\nX-Pad: ",
    "body": b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n",
    "chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    "error-body": b"HTTP/1.1 500 Oops\r\nContent-Length: 100000000\r\n\r\n",
}


@pytest.mark.parametrize("part", list(SLOW_ANSWERS))
def test_an_answer_that_trickles_in_is_too_slow_past_the_timeout(part):
    from kiln.client.comfy import ServerTooSlow

    client = ComfyClient(f"http://127.0.0.1:{trickling_server(SLOW_ANSWERS[part])}", timeout=0.3)
    start = time.monotonic()
    with pytest.raises(ServerTooSlow, match="^the server was too slow answering /history/p1: not all of it came "
                                            "within 0.3s, the client's timeout$"):
        client.history("p1")
    assert time.monotonic() - start < 1.5


def test_a_server_that_sends_nothing_for_the_read_wait_is_too_slow(monkeypatch):
    from kiln.client.comfy import ServerTooSlow

    import socket

    monkeypatch.setattr(comfy_module, "READ_WAIT_SECONDS", 0.2)

    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    with listener:
        start = time.monotonic()
        with pytest.raises(ServerTooSlow, match="^the server was too slow answering /object_info: nothing came for 0.2s$"):
            ComfyClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=30).object_info()
        assert time.monotonic() - start < 1.5


CERTS = Path(sysconfig.get_paths()["stdlib"]) / "test" / "certdata"  # CPython's own test certificates


@pytest.mark.skipif(not (CERTS / "keycert3.pem").exists(), reason="CPython's test certificates are not installed")
def test_an_https_answer_that_trickles_in_is_too_slow_past_the_timeout(monkeypatch):
    import functools
    import ssl

    from kiln.client.comfy import ServerTooSlow, _tls_context

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(CERTS / "keycert3.pem")  # localhost, signed by pycacert.pem
    monkeypatch.setattr(ssl, "create_default_context", functools.partial(ssl.create_default_context,
                                                                         cafile=str(CERTS / "pycacert.pem")))
    _tls_context.cache_clear()
    try:
        client = ComfyClient(f"https://localhost:{trickling_server(SLOW_ANSWERS['body'], server)}", timeout=0.5)
        start = time.monotonic()
        with pytest.raises(ServerTooSlow, match="^the server was too slow answering /history/p1: not all of it came"):
            client.history("p1")
        assert time.monotonic() - start < 2
    finally:
        _tls_context.cache_clear()
