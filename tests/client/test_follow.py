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
