"""client/follow.py: the websocket's JSON messages are checked before they are read (a message that is
not JSON, not an object, its data not an object, a field of the wrong type: the 'the server sent' error),
and the progress bar takes whatever numbers come. `kiln queue` end to end is in test_queue.py."""
import io
import json

import pytest

from kiln.client.comfy import ServerAnswerError
from kiln.client.follow import PromptRun, _event, json_message
from kiln.client.progress_bar import WIDTH, ProgressBar


class Display:
    def __init__(self):
        self.steps = []

    def node(self, node_id, title):
        pass

    def step(self, node_id, title, value, maximum):
        self.steps.append((value, maximum))

    def work(self, text):
        self.steps.append(text)

    def done(self):
        pass


@pytest.mark.parametrize("text, says", [
    ("{nope", "a websocket message that is not JSON \\(JSONDecodeError: .*\\): '\\{nope'"),
    ("[" * 100000 + "]" * 100000, "a websocket message that is not JSON \\(RecursionError: "),
    ("[1, 2]", "a websocket message as a list, not a JSON object: \\[1, 2\\]"),
    ('"status"', "a websocket message as a string, not a JSON object"),
    ('{"type": "status", "data": [1]}', "'data' in a websocket message of type 'status' as a list, not a JSON "
                                        "object: \\[1\\]"),
])
def test_a_websocket_message_that_is_no_json_object_says_what_the_server_sent(text, says):
    with pytest.raises(ServerAnswerError, match="^the server sent " + says):
        json_message(text)


@pytest.mark.parametrize("data, says", [
    ({"type": "progress", "data": {"value": "3", "max": 3}}, "'value' in the websocket's 'progress' message as '3'"),
    ({"type": "progress", "data": {"value": 1, "max": float("nan")}}, "'max' in .* as nan, not a number of steps"),
    ({"type": "progress", "data": {"value": float("inf"), "max": 3}}, "'value' in .* as inf"),
    ({"type": "progress", "data": {"value": 10**400, "max": 3}}, "'value' in .* as 1000000"),
    ({"type": "progress", "data": {"value": True, "max": 3}}, "'value' in .* as True"),
    ({"type": "execution_cached", "data": {"nodes": 5}}, "'nodes' in the websocket's 'execution_cached' message "
                                                        "as a number, not a list"),
])
def test_a_field_of_the_wrong_type_in_this_prompts_message(data, says):
    run = PromptRun("p1", 0.0)
    data["data"]["prompt_id"] = "p1"
    message = json_message(json.dumps(data))  # NaN and Infinity are what Python's json reads from a server too
    with pytest.raises(ServerAnswerError, match="^the server sent " + says):
        _event(message, run, {}, Display())


def test_another_prompts_message_is_not_read():
    display = Display()
    message = json_message('{"type": "progress", "data": {"prompt_id": "p2", "value": "x", "max": []}}')
    assert _event(message, PromptRun("p1", 0.0), {}, display) is False and display.steps == []


@pytest.mark.parametrize("value, maximum, filled", [
    (3, 6, WIDTH // 2), (7, 6, WIDTH), (-5, 6, 0), (5, 0, 0), (5, -1, 0), (1e15, 1e-300, WIDTH), (1e-300, 1e15, 0),
])
def test_the_progress_bar_takes_any_numbers(value, maximum, filled):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    ProgressBar("prompt 1/1", stream).step("3", "KSampler (3)", value, maximum)
    assert f"[{'#' * filled}{'-' * (WIDTH - filled)}]  {value}/{maximum}" in stream.getvalue()


def test_a_compile_round_trips_from_the_node_to_kiln_queue(monkeypatch):
    """What Compile UNet shows and sends for a compile (nodes/plan_wrapper.py) is what `kiln queue` reads:
    the line on the node, behind its title, and the record (events.py) its time and variant come from."""
    import struct
    import sys
    import types

    from kiln.client.follow import _progress_text
    from kiln.compiler.stats import GraphCompile, KilnStats
    from kiln.events import COMPILE_EVENT
    from kiln.nodes import plan_wrapper

    sent = []

    class Server:  # ComfyUI's PromptServer: what the node calls, as the server puts it on the websocket
        client_id, last_prompt_id = "me", "p1"

        def send_progress_text(self, text, node_id):
            node = node_id.encode()
            sent.append(struct.pack(">II", 3, len(node)) + node + text.encode())

        def send_sync(self, event, data, sid=None):
            assert sid == "me"
            sent.append(json.dumps({"type": event, "data": data}))

    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=Server())))
    stats = KilnStats(options={})
    stats.compiles.append(GraphCompile(index=0, reason="first compile\nUser stack trace: ...", lowering="inductor",
                                       input_shapes=[[2, 4, 8, 8]], nodes=9, rewrites={}, skipped={}, seconds=30.04,
                                       dynamic=True, capture_seconds=4.2, region="ResBlock#1"))
    plan_wrapper.show_compiles_since("2", stats, (0, 0, 0))

    prompt = {"2": {"class_type": "KilnCompileUNet", "_meta": {"title": "Kiln › Compile UNet"}}}
    run, display = PromptRun("p1", 0.0, started=0.0), Display()
    display.note = lambda line: None
    for message in sent:
        if isinstance(message, bytes):
            _progress_text(message, run, {"2": "Kiln › Compile UNet (2)"}, display)
        else:
            assert _event(json_message(message), run, prompt, display) is False
    line = "Kiln compiled graph 0 in 34.2s (inductor, dynamic shapes) for region ResBlock#1: first compile"
    assert run.kiln_lines == [f"Kiln › Compile UNet (2): {line}"]
    assert [shown["event"] for shown in run.kiln_compiles] == [stats.compiles[0].event()]
    assert run.kiln_compiles[0]["node"] == "Kiln › Compile UNet (2)" and run.kiln_compiles[0]["event"].line() == line
    assert (run.kiln_compile_seconds, run.kiln_variants) == (34.2, ["inductor, dynamic shapes"])
    assert json.loads(sent[1])["type"] == COMPILE_EVENT


@pytest.mark.parametrize("event, says", [
    (None, "without its record"),
    ({"index": 0, "seconds": "1.5", "lowering": "fx", "dynamic": True, "reason": "x"}, "'seconds' is '1.5'"),
    ({"index": True, "seconds": 1.5, "lowering": "fx", "dynamic": True, "reason": "x"}, "'index' is True"),
    ({"index": 0, "seconds": 1.5, "lowering": "fx", "reason": "x"}, "'dynamic' is None"),
])
def test_a_compile_event_that_is_no_record_says_what_the_server_sent(event, says):
    message = {"type": "kiln.compile", "data": {"prompt_id": "p1", "node": "2", "event": event}}
    with pytest.raises(ServerAnswerError, match="^the server sent a Kiln compile event .*" + says):
        _event(json_message(json.dumps(message)), PromptRun("p1", 0.0), {}, Display())


def test_compile_progress_round_trips_from_the_node_to_kiln_queue_s_line(monkeypatch):
    """What a Kiln node's progress callback sends (nodes/plan_wrapper.py) is what `kiln queue` draws in
    its progress line, control characters from the server shown as '?'."""
    import sys
    import types

    from kiln.events import WORK_PROGRESS, WorkProgress
    from kiln.nodes import plan_wrapper

    sent = []

    class Server:
        client_id, last_prompt_id, last_node_id = "me", "p1", "6"

        def send_sync(self, event, data, sid=None):
            assert sid == "me"
            sent.append(json.dumps({"type": event, "data": data}))

    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=Server())))
    plan_wrapper.send_progress(WorkProgress("compile", "region 4/11 ResBlock#2: pass fuse_geglu", 3, 11))
    plan_wrapper.send_progress(WorkProgress("compile", "region 5/11 \x1b[2J\x07", 4, 11))
    display = Display()
    for message in sent:
        assert json.loads(message)["type"] == WORK_PROGRESS and json.loads(message)["data"]["node"] == "6"
        assert _event(json_message(message), PromptRun("p1", 0.0), {}, display) is False
    assert display.steps == ["Kiln compile 3/11: region 4/11 ResBlock#2: pass fuse_geglu",
                             "Kiln compile 4/11: region 5/11 ?[2J?"]


@pytest.mark.parametrize("event, says", [
    ("nope", "without its record"),
    ({"work": "compile", "what": "x", "done": "3", "total": 11}, "'done' is '3'"),
    ({"work": "compile", "what": "x", "done": 3}, "'total' is None"),
])
def test_a_progress_event_that_is_no_record_says_what_the_server_sent(event, says):
    message = {"type": "kiln.progress", "data": {"prompt_id": "p1", "node": "6", "event": event}}
    with pytest.raises(ServerAnswerError, match="^the server sent a Kiln progress event .*" + says):
        _event(json_message(json.dumps(message)), PromptRun("p1", 0.0), {}, Display())


def test_a_long_progress_text_is_cut():
    from kiln.client.comfy import printable

    assert printable("x" * 1000) == "x" * 197 + "..." and printable("ok") == "ok"


def test_node_text_and_titles_reach_the_terminal_without_control_characters():
    """A hostile server's node text, or a stranger's workflow's node title, cannot move the cursor,
    clear the screen or retitle the terminal: their control characters are shown as '?'."""
    import struct

    from kiln.client.follow import _progress_text, _title

    prompt = {"2": {"class_type": "KilnCompileUNet", "_meta": {"title": "Kiln\x1b]0;pwned\x07"}}}
    assert _title(prompt, "2") == "Kiln?]0;pwned? (2)"
    run, shown_lines = PromptRun("p1", 0.0, started=0.0), []
    display = Display()
    display.note = shown_lines.append
    text = "compiled\x1b[2J graph 0".encode()
    _progress_text(struct.pack(">II", 3, 1) + b"2" + text, run, {"2": _title(prompt, "2")}, display)
    assert run.kiln_lines == shown_lines == ["Kiln?]0;pwned? (2): compiled?[2J graph 0"]


# -- what a prompt's run keeps is capped: a server cannot fill the client's memory with it

def kiln_text(text: bytes, node: bytes = b"2") -> bytes:
    import struct

    return struct.pack(">II", 3, len(node)) + node + text


def test_kiln_lines_past_the_cap_are_counted_not_kept_nor_shown():
    from kiln.client.follow import KILN_LINES_LEFT_OUT, MAX_KEPT, _progress_text

    run, shown_lines = PromptRun("p1", 0.0, started=0.0), []
    display = Display()
    display.note = shown_lines.append
    _progress_text(kiln_text(b"a\n\n" * (MAX_KEPT - 1)), run, {"2": "Kiln (2)"}, display)  # blank lines are skipped
    _progress_text(kiln_text(b"b\r\n" * 6 + b" \t\n\n\r\nc"), run, {"2": "Kiln (2)"}, display)
    assert run.kiln_lines == shown_lines == ["Kiln (2): a"] * (MAX_KEPT - 1) + ["Kiln (2): b"]
    assert run.left_out == {KILN_LINES_LEFT_OUT: 6}  # 5 b and a c; blank lines are not counted
    _progress_text(kiln_text(b"\n\nd\ne"), run, {"2": "Kiln (2)"}, display)
    assert run.left_out == {KILN_LINES_LEFT_OUT: 8} and len(shown_lines) == MAX_KEPT


def executing(node) -> dict:
    return json_message(json.dumps({"type": "executing", "data": {"prompt_id": "p1", "node": node}}))


def test_node_ids_past_the_cap_or_too_long_are_counted_not_kept():
    from kiln.client.follow import BAD_NODE_IDS_LEFT_OUT, MAX_KEPT, NODE_IDS_LEFT_OUT

    run, display = PromptRun("p1", 0.0), Display()
    for node in ["n" * 2**20, {"id": 3}, True, "n" * 201]:
        assert _event(executing(node), run, {}, display) is False
    assert run.executed == [] and run.left_out == {BAD_NODE_IDS_LEFT_OUT: 4}
    for number in range(MAX_KEPT + 2):
        _event(executing(number), run, {}, display)
    assert run.executed == [str(number) for number in range(MAX_KEPT)] and run.left_out[NODE_IDS_LEFT_OUT] == 2
    cached = json_message(json.dumps({"type": "execution_cached", "data": {"prompt_id": "p1", "nodes": ["3", "x" * 300]}}))
    _event(cached, run, {}, display)
    assert run.cached == ["3"] and run.left_out[BAD_NODE_IDS_LEFT_OUT] == 5


def compile_message(seconds, **fields) -> dict:
    event = {"index": 0, "seconds": seconds, "lowering": "inductor", "dynamic": True, "reason": "first", **fields}
    return json_message(json.dumps({"type": "kiln.compile", "data": {"prompt_id": "p1", "node": "2", "event": event}}))


def test_compile_records_past_the_cap_are_counted_and_their_time_still_added():
    from kiln.client.follow import COMPILES_LEFT_OUT, MAX_KEPT

    run = PromptRun("p1", 0.0)
    for _ in range(MAX_KEPT + 3):
        _event(compile_message(0.5), run, {}, Display())
    assert len(run.kiln_compiles) == MAX_KEPT and run.left_out == {COMPILES_LEFT_OUT: 3}
    assert run.kiln_compile_seconds == 0.5 * (MAX_KEPT + 3)


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0, -1e300, 1e300, 1e6 + 1])
def test_a_compile_time_that_is_no_time_says_what_the_server_sent(seconds):
    import re

    with pytest.raises(ServerAnswerError, match="^" + re.escape(f"the server sent a Kiln compile event whose 'seconds' is "
                                                                f"{seconds!r}, not a time from 0 to 1e+06 seconds, in the "
                                                                "websocket's 'kiln.compile' message")):
        _event(compile_message(seconds), PromptRun("p1", 0.0), {}, Display())


def test_a_compile_records_text_is_cut_and_without_control_characters():
    run = PromptRun("p1", 0.0)
    _event(compile_message(1e6, lowering="fx\x1b[2J", reason="r" * 5000, region="\x07"), run, {}, Display())
    event = run.kiln_compiles[0]["event"]
    assert (event.lowering, event.region, len(event.reason)) == ("fx?[2J", "?", 1000) and event.reason.endswith("...")
    assert run.kiln_variants == ["fx?[2J, dynamic shapes"] and run.kiln_compile_seconds == 1e6
