"""Following one queued prompt to its end over ComfyUI's websocket: when it left the queue, which node
runs and how far it is (for the progress bar), what Kiln's nodes said about compiling, and how it ended.

ComfyUI's JSON messages (`{"type", "data"}`) carry the prompt id. Its binary messages start with a 4-byte
big-endian event type; type 3 is a node's progress text: a 4-byte big-endian length, the node id, then
the text (utf-8). Kiln's nodes show one line per compile there, e.g.
'Kiln compiled graph 0 in 34.2s (inductor, dynamic shapes): first compile', 'Kiln variant: ...' lines
and cache hits and misses. Each line is kept behind the title and id of the node that showed it
('Kiln › Compile UNet (2): Kiln compiled graph 0 ...'): Compile UNet and Compile ControlNet both number
their graphs from 0. Each compile also comes as its record, a JSON message of type COMPILE_EVENT
(events.py, read by the code that wrote it): the compile time and variants are taken from those, never
read back from the text.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import time
from dataclasses import dataclass, field

from ..events import COMPILE_EVENT, WORK_PROGRESS, CompileEvent, WorkProgress
from .comfy import (ComfyClient, PromptFailed, PromptTimedOut, ServerAnswerError, check_record, execution_error_text,
                    optional, printable, require, shown)
from .workflow import MAX_NODE_ID_CHARS

PROGRESS_TEXT = 3  # ComfyUI's BinaryEventTypes.TEXT
QUIET_SECONDS = 10.0  # with no message for this long, the history says whether the prompt ended unseen
HISTORY_WAIT_SECONDS = 10.0  # the history record is written just after the prompt's last message
MAX_LINE = 1000  # characters of a line from the server or the workflow shown on the terminal
MAX_COUNT = 1e15  # a progress value or max past this (or NaN, or infinite) is no count of steps
MAX_KEPT = 1000  # Kiln lines, compile records, node ids kept per prompt; past this they are counted, not kept
MAX_COMPILE_SECONDS = 1e6  # a compile record's time past this (11 days; or negative, NaN, infinite) is no time
KILN_LINES_LEFT_OUT = f"lines from Kiln's nodes past the first {MAX_KEPT}"
COMPILES_LEFT_OUT = f"compile records past the first {MAX_KEPT} (their time is in the total)"
NODE_IDS_LEFT_OUT = f"node ids (run or cached) past the first {MAX_KEPT}"
BAD_NODE_IDS_LEFT_OUT = (f"node ids from the server that are not a number or text of at most {MAX_NODE_ID_CHARS} "
                         "characters")


@dataclass
class PromptRun:
    """One prompt's timings (time.monotonic() seconds) and what Kiln's nodes reported while it ran."""
    prompt_id: str
    submitted: float
    started: float | None = None
    finished: float | None = None
    executed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    kiln_lines: list[str] = field(default_factory=list)
    kiln_compiles: list[dict] = field(default_factory=list)  # {"node": its title and id, "event": a CompileEvent}
    compile_seconds: float = 0.0  # every compile record's, kept or not
    left_out: dict[str, int] = field(default_factory=dict)  # what was not kept (KILN_LINES_LEFT_OUT, ...) -> how many
    record: dict | None = None

    def keep(self, kept: list, item, what: str) -> bool:
        """Add `item` to `kept` (one of this run's lists) while it holds fewer than MAX_KEPT; past that
        count it in left_out under `what`. True if it was kept."""
        if len(kept) < MAX_KEPT:
            kept.append(item)
            return True
        self.leave_out(what)
        return False

    def leave_out(self, what: str, count: int = 1) -> None:
        """Count `count` items of `what` (KILN_LINES_LEFT_OUT, ...) as not kept."""
        self.left_out[what] = self.left_out.get(what, 0) + count

    @property
    def queue_seconds(self) -> float | None:
        return None if self.started is None else self.started - self.submitted

    @property
    def run_seconds(self) -> float | None:
        return None if self.started is None or self.finished is None else self.finished - self.started

    @property
    def total_seconds(self) -> float | None:
        return None if self.finished is None else self.finished - self.submitted

    @property
    def kiln_compile_seconds(self) -> float:
        return self.compile_seconds

    @property
    def kiln_variants(self) -> list[str]:
        """The compiles' variants ('inductor, dynamic shapes'), each once, in order."""
        return list(dict.fromkeys(shown["event"].variant for shown in self.kiln_compiles))


def follow(ws, client: ComfyClient, run: PromptRun, prompt: dict, display, deadline: float) -> PromptRun:
    """Read the websocket until `run`'s prompt ends; its history record is then in run.record.
    PromptFailed if it failed or was interrupted, PromptTimedOut at `deadline` (time.monotonic())."""
    kiln_nodes = {node_id: _title(prompt, node_id) for node_id, node in prompt.items()
                  if str(node.get("class_type", "")).startswith("Kiln")}
    quiet_since = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise _timed_out(run, deadline)
        message = ws.receive(timeout=min(deadline - now, 1.0))
        if message is None:
            if time.monotonic() - quiet_since >= QUIET_SECONDS:  # a missed end: the history knows
                quiet_since = time.monotonic()
                record = client.history(run.prompt_id)
                if record is not None:
                    run.finished = run.finished or time.monotonic()
                    run.record = check_record(run.prompt_id, record)
                    return run
            continue
        quiet_since = time.monotonic()
        if isinstance(message, bytes):
            _progress_text(message, run, kiln_nodes, display)
        elif _event(json_message(message), run, prompt, display):
            run.record = _history(client, run)
            return run


def poll(client: ComfyClient, run: PromptRun, deadline: float) -> PromptRun:
    """Without the websocket: wait for the prompt's history record (its total time only)."""
    while True:
        record = client.history(run.prompt_id)
        if record is not None:
            run.finished = time.monotonic()
            run.record = check_record(run.prompt_id, record)
            return run
        if time.monotonic() >= deadline:
            raise _timed_out(run, deadline)
        time.sleep(0.25)


def _timed_out(run: PromptRun, deadline: float) -> PromptTimedOut:
    return PromptTimedOut(f"prompt {run.prompt_id} did not finish within {deadline - run.submitted:.0f}s "
                          "(it may still be queued or running on the server)")


def json_message(text: str) -> dict:
    """A JSON message from the websocket ({"type": ..., "data": {...}}), checked to be one;
    ServerAnswerError if it is not JSON, not an object, or its data is not an object."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ServerAnswerError(f"the server sent a websocket message that is not JSON ({exc.__class__.__name__}: "
                                f"{shown(str(exc))}): {shown(text)}") from None
    message = require(message, dict, "a websocket message")
    optional(message, "data", dict, f"a websocket message of type {shown(message.get('type'))}")
    return message


def _event(message: dict, run: PromptRun, prompt: dict, display) -> bool:
    """Take one JSON message (checked by json_message) into `run`; True when it ends the prompt."""
    kind, data = message.get("type"), message.get("data") or {}
    if data.get("prompt_id") != run.prompt_id:
        return False  # status messages, and other prompts'
    where = f"the websocket's {shown(kind)} message"
    if kind == "execution_start":
        run.started = time.monotonic()
    elif kind == "execution_cached":
        run.cached = []
        for node in optional(data, "nodes", list, where):
            node_id = _node_id(node, run)
            if node_id is not None:
                run.keep(run.cached, node_id, NODE_IDS_LEFT_OUT)
    elif kind == "executing" and data.get("node") is not None:
        node_id = _node_id(data["node"], run)
        if node_id is not None:
            run.keep(run.executed, node_id, NODE_IDS_LEFT_OUT)
            display.node(node_id, _title(prompt, node_id))
    elif kind == COMPILE_EVENT:
        event = _compile_event(data, where)
        run.compile_seconds += event.seconds
        run.keep(run.kiln_compiles, {"node": _title(prompt, str(data.get("node"))), "event": event}, COMPILES_LEFT_OUT)
    elif kind == WORK_PROGRESS:
        try:
            progress = WorkProgress.from_message(data)
        except ValueError as exc:
            raise ServerAnswerError(f"the server sent {exc} in {where}: {shown(data)}") from None
        display.work(printable(progress.line()))
    elif kind == "progress":
        node_id = str(data.get("node"))
        display.step(node_id, _title(prompt, node_id), _count(data, "value", where), _count(data, "max", where))
    elif kind in ("execution_error", "execution_interrupted"):
        run.finished = time.monotonic()
        display.done()
        raise PromptFailed(f"prompt {run.prompt_id} failed: {execution_error_text(kind, data)}")
    elif kind == "execution_success" or kind == "executing" and data.get("node") is None:
        run.finished = time.monotonic()
        display.done()
        return True
    return False


def _node_id(value, run: PromptRun) -> str | None:
    """A node id the server sent, as text; None (counted in run.left_out) for one that is neither a
    number nor text, or longer than MAX_NODE_ID_CHARS: no node of a workflow has such an id."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or len(text) > MAX_NODE_ID_CHARS:
        run.leave_out(BAD_NODE_IDS_LEFT_OUT)
        return None
    return text


def _compile_event(data: dict, where: str) -> CompileEvent:
    """The CompileEvent in a COMPILE_EVENT message: its seconds a time from 0 to MAX_COMPILE_SECONDS, its
    text fields cut to MAX_LINE characters without control characters (they go on the terminal and into
    --json). ServerAnswerError naming the field that is not."""
    try:
        event = CompileEvent.from_message(data)
    except ValueError as exc:
        raise ServerAnswerError(f"the server sent {exc} in {where}: {shown(data)}") from None
    if not (math.isfinite(event.seconds) and 0 <= event.seconds <= MAX_COMPILE_SECONDS):
        raise ServerAnswerError(f"the server sent a Kiln compile event whose 'seconds' is {event.seconds!r}, not a "
                                f"time from 0 to {MAX_COMPILE_SECONDS:g} seconds, in {where}: {shown(data)}")
    return dataclasses.replace(event, lowering=printable(event.lowering, MAX_LINE),
                               reason=printable(event.reason, MAX_LINE), region=printable(event.region, MAX_LINE))


def _count(data: dict, key: str, where: str) -> float:
    """A progress message's value or max: a number within +-MAX_COUNT (0 when absent)."""
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_COUNT <= value <= MAX_COUNT:
        raise ServerAnswerError(f"the server sent {key!r} in {where} as {shown(value)}, not a number of steps")
    return value


def _progress_text(message: bytes, run: PromptRun, kiln_nodes: dict, display) -> None:
    """A node's progress text; lines from Kiln's nodes while this prompt runs are kept (MAX_KEPT of them;
    the rest are counted in run.left_out), each behind the node's title and id, and shown."""
    if len(message) < 8 or struct.unpack(">I", message[:4])[0] != PROGRESS_TEXT or run.started is None:
        return  # previews and other binary messages, and text sent before this prompt started
    length = struct.unpack(">I", message[4:8])[0]
    node_id = message[8:8 + length].decode(errors="replace")
    if node_id not in kiln_nodes:
        return
    text = message[8 + length:].decode(errors="replace")
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        line, start = text[start:end].strip(), end + 1
        if not line:
            continue
        if not run.keep(run.kiln_lines, f"{kiln_nodes[node_id]}: {printable(line, MAX_LINE)}", KILN_LINES_LEFT_OUT):
            run.leave_out(KILN_LINES_LEFT_OUT, _count_lines(text, start))  # past the cap: the rest only counted
            return
        display.note(run.kiln_lines[-1])


_TEXT_LINE = re.compile(r"[^\S\n]*\S[^\n]*")  # a line that is not blank: one match each


def _count_lines(text: str, start: int) -> int:
    """How many lines of `text` from `start` are not blank (at the regular expression engine's speed)."""
    return sum(1 for _ in _TEXT_LINE.finditer(text, start))


def _history(client: ComfyClient, run: PromptRun) -> dict:
    """The finished prompt's history record (written just after its last message)."""
    deadline = time.monotonic() + HISTORY_WAIT_SECONDS
    while True:
        record = client.history(run.prompt_id)
        if record is not None:
            return check_record(run.prompt_id, record)
        if time.monotonic() > deadline:
            raise PromptFailed(f"prompt {run.prompt_id} ended, but the server has no history record of it")
        time.sleep(0.05)


def _title(prompt: dict, node_id: str) -> str:
    node = prompt.get(node_id) or {}
    title = (node.get("_meta") or {}).get("title") or node.get("class_type") or "node"
    return printable(f"{title} ({node_id})", MAX_LINE)
