"""A client for a running ComfyUI's HTTP API, standard library only (never imports ComfyUI).

`kiln queue` submits prompts, reads their history and downloads their images with it; `kiln warm`
queues a workflow at each resolution and batch size ahead of time.
"""
from __future__ import annotations

import functools
import http.client
import json
import os
import reprlib
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional

MAX_ANSWER_BYTES = 256 * 2**20  # a JSON answer; /object_info with many node packs is tens of MiB
MAX_IMAGE_BYTES = 1024 * 2**20  # an image a server sends (a 16-bit 8192x8192 PNG is under 512 MiB)
MAX_NAME_TRIES = 1000  # name.png, name-1.png, ... name-999.png: past that the folder is full of this image
MAX_NAME_BYTES = 200  # an image's file name; leaves room for '-999' under the usual 255-byte limit
MAX_ERROR_LINES = 40  # lines of a failed prompt's error, or node errors of a rejected one, shown; the rest counted
MAX_ERROR_FIELD = 500  # characters of one field of a rejection (its error, a node's message or details)
READ_WAIT_SECONDS = 60.0  # the longest one read from the server waits for a byte (less when the timeout is shorter)


class ComfyError(RuntimeError):
    """The server is unreachable, rejected a prompt, or a prompt failed; the message says which."""


class ComfyUnreachable(ComfyError):
    """No ComfyUI answers at the server address."""


class PromptRejected(ComfyError):
    """ComfyUI refused to queue the prompt (its node errors are in the message)."""


class PromptFailed(ComfyError):
    """The prompt was queued and failed (or was interrupted) while running."""


class PromptTimedOut(ComfyError):
    """The prompt did not finish in time; it may still be queued or running on the server."""


class ServerTooSlow(ComfyError):
    """The server's answer to a request did not come whole within the client's timeout, or nothing came
    for READ_WAIT_SECONDS; the message names the request."""


class ServerAnswerError(ComfyError):
    """The server's answer makes no sense: cut short, not UTF-8 or not JSON, or not the shape its
    endpoint gives (a list for an object, a field missing, an image name that is no file name). The
    message starts 'the server sent' and names the endpoint and what was wrong."""


# ---------------------------------------------------------------------------------------------------
# checking what the server sent: an answer is untrusted (servers are shared on a LAN, or rented)

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


def shown(value) -> str:
    """A value from the server, shortened, on one line, for an error message."""
    return _SHORT.repr(value)


def printable(text: str, limit: int = 200) -> str:
    """Text from the server or a workflow as it may go on a terminal: control characters (escape
    sequences among them) shown as '?', at most `limit` characters."""
    text = "".join(c if c.isprintable() else "?" for c in str(text)[:limit + 1])
    return text if len(text) <= limit else text[:limit - 3] + "..."


def listing(items, most: int = 8) -> str:
    """'a, b, c and 5 more': the first `most` items, each printable() and cut to 80 characters; 'none'."""
    items = list(items)
    if not items:
        return "none"
    shown_items = ", ".join(printable(item, 80) for item in items[:most])
    return shown_items + (f" and {len(items) - most} more" if len(items) > most else "")


_KINDS = {dict: "a JSON object", list: "a list", str: "a string"}


def json_kind(value) -> str:
    """What a JSON value is, for an error message: 'a JSON object', 'a list', 'a number', 'null', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return "a number"
    return _KINDS.get(type(value), type(value).__name__)


def require(value, kind: type, where: str):
    """`value` if it is a `kind` (dict, list or str); else ServerAnswerError saying what `where`
    ("/prompt's answer") was instead."""
    if isinstance(value, kind):
        return value
    raise ServerAnswerError(f"the server sent {where} as {json_kind(value)}, not {_KINDS[kind]}: {shown(value)}")


def optional(parent: dict, key: str, kind: type, where: str):
    """parent[key] checked to be a `kind`; an empty one when it is absent or null."""
    value = parent.get(key)
    return kind() if value is None else require(value, kind, f"{key!r} in {where}")


class ComfyClient:
    def __init__(self, server: str = "http://127.0.0.1:8188", timeout: float = 3600.0):
        self.server = server.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex

    def _open(self, path: str, body: Optional[dict] = None):
        """The server's answer to a request, its body still to read: all of it, head and body, must come
        within the client's timeout (ServerTooSlow, naming the request, if not)."""
        data = json.dumps(body).encode() if body is not None else None
        deadline = Deadline(self.timeout)
        try:
            if urllib.parse.urlsplit(self.server).scheme not in ("http", "https"):
                raise ValueError("it does not start with http:// or https://")
            request = urllib.request.Request(self.server + path, data=data,
                                             headers={"Content-Type": "application/json"})
            opener = urllib.request.build_opener(_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline))
            return opener.open(request, timeout=deadline.wait())
        except urllib.error.HTTPError as exc:
            with exc:
                detail = _read_answer(exc, path).decode(errors="replace")
            if path == "/prompt":
                raise PromptRejected(_rejection(detail)) from None
            raise ComfyError(f"{self.server}{path}: HTTP {exc.code}: {shown(detail)}") from None
        except (ValueError, http.client.InvalidURL) as exc:
            raise ComfyError(f"{self.server!r} is not a server address such as http://127.0.0.1:8188 ({exc})") from None
        except http.client.HTTPException as exc:  # after the connection was made: no answer, or not an HTTP one
            raise ServerAnswerError(f"the server sent no HTTP answer to {path} ({_why(exc)})") from None
        except TimeoutError as exc:  # connected and asked, but the answer's head did not come in time
            raise _too_slow(path, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, DeadlinePassed):  # connected, but sending the request took past the timeout
                raise _too_slow(path, reason) from None
            raise ComfyUnreachable(f"cannot reach ComfyUI at {self.server} ({reason}): is it running?") from None

    def _request(self, path: str, body: Optional[dict] = None) -> Any:
        """The JSON an endpoint answers (None for an empty answer). ServerAnswerError if the answer is
        cut short, too long, not UTF-8 or not JSON."""
        with self._open(path, body) as response:
            raw = _read_answer(response, path)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ServerAnswerError(f"the server sent {path}'s answer in an encoding that is not UTF-8 "
                                    f"({exc.reason} at byte {exc.start}): {shown(raw)}") from None
        try:
            return json.loads(text) if text else None
        except (ValueError, RecursionError) as exc:
            raise ServerAnswerError(f"the server sent {path}'s answer not as JSON ({_why(exc)}): {shown(text)}: "
                                    f"is {self.server} a ComfyUI server?") from None

    def object_info(self) -> dict:
        """The server's node definitions: {class name: {input, input_order, output, ...}}, checked to
        have the shape kiln reads (ServerAnswerError if not)."""
        return node_definitions(self._request("/object_info"))

    def submit(self, prompt: dict) -> str:
        """Queue an API-format prompt; its prompt id. PromptRejected with the node errors if refused."""
        answer = require(self._request("/prompt", {"prompt": prompt, "client_id": self.client_id}), dict,
                         "/prompt's answer")
        if "prompt_id" not in answer:
            raise ServerAnswerError(f"the server sent /prompt's answer without a prompt_id: {shown(answer)}")
        prompt_id = answer["prompt_id"]
        if not isinstance(prompt_id, str) or not prompt_id or not prompt_id.isprintable() or len(prompt_id) > 256:
            raise ServerAnswerError(f"the server sent a prompt_id that is not a short line of text in /prompt's "
                                    f"answer: {shown(prompt_id)}")
        return prompt_id

    def history(self, prompt_id: str) -> Optional[dict]:
        """A prompt's history record once it has finished (or failed); None before. The record is
        checked to have the shape kiln reads (ServerAnswerError if not)."""
        path = f"/history/{urllib.parse.quote(prompt_id, safe='')}"
        record = require(self._request(path), dict, f"{path}'s answer").get(prompt_id)
        if record is None:
            return None
        record = history_record(record, f"{path}'s record")
        return record if (record.get("status") or {}).get("completed") is not None else None

    def wait(self, prompt_id: str, poll: float = 0.5) -> dict:
        """Wait for a prompt to finish, polling its history; its history record. PromptFailed if it
        failed, PromptTimedOut if it did not finish within the client's timeout."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            record = self.history(prompt_id)
            if record is not None:
                return check_record(prompt_id, record)
            time.sleep(poll)
        raise PromptTimedOut(f"prompt {prompt_id} did not finish within {self.timeout:.0f}s "
                             "(it may still be queued or running on the server)")

    def cancel(self, prompt_id: str) -> None:
        """Take a prompt off the queue, or interrupt it if it is running."""
        self._request("/queue", {"delete": [prompt_id]})
        self._request("/interrupt", {"prompt_id": prompt_id})

    def download(self, image: dict, folder: Path) -> Path:
        """Save one output image ({filename, subfolder, type} from a history record) into `folder`
        through GET /view; its path. The file is named after the last part of the server's name, and
        made new: a file or link of that name already there gets name-1.png (name-2.png, ...) beside
        it, never overwritten or followed. Nothing is left behind if the download breaks."""
        name = image_file_name(image.get("filename"), "the image to download")
        # a null subfolder or type (history_record lets them through) is sent as the server's default, not "None"
        subfolder, kind = image.get("subfolder"), image.get("type")
        query = urllib.parse.urlencode({"filename": image["filename"],
                                        "subfolder": "" if subfolder is None else subfolder,
                                        "type": "output" if kind is None else kind})
        with self._open(f"/view?{query}") as response:
            path, file = _create_new_file(Path(folder), name)
            try:
                with file:
                    _copy_answer(response, file, "/view")
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        return path

    def websocket_url(self) -> str:
        """ws(s)://HOST:PORT/ws?clientId=<this client's id>: the server's messages about our prompts."""
        parts = urllib.parse.urlsplit(self.server)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}{parts.path}/ws?clientId={self.client_id}"


def check_record(prompt_id: str, record: dict) -> dict:
    """A finished prompt's history record; PromptFailed if it says the prompt failed."""
    status = record.get("status") or {}
    if status.get("status_str") == "error":
        raise PromptFailed(f"prompt {prompt_id} failed: {_execution_error(status)}")
    return record


def output_images(record: dict) -> list[dict]:
    """The images ({filename, subfolder, type}) a history record lists, by output node."""
    outputs = record.get("outputs") or {}
    return [image for node_id in sorted(outputs, key=lambda k: (len(k), k))
            for image in outputs[node_id].get("images") or []]


# ---------------------------------------------------------------------------------------------------
# the shapes of the server's answers, checked where they are read

def history_record(record, where: str) -> dict:
    """A prompt's history record, checked to have the shape check_record and output_images read:
    {"status": {"messages": [[kind, {...}], ...], ...}, "outputs": {node id: {"images": [{"filename":
    a file name, "subfolder": str, "type": str}, ...]}}}. ServerAnswerError names what is not."""
    record = require(record, dict, where)
    status = optional(record, "status", dict, where)
    for message in optional(status, "messages", list, f"'status' in {where}"):
        if not (isinstance(message, list) and len(message) == 2 and isinstance(message[0], str)
                and isinstance(message[1], dict)):
            raise ServerAnswerError(f"the server sent a status message that is not [kind, {{...}}] in {where}: "
                                    f"{shown(message)}")
    for node_id, output in optional(record, "outputs", dict, where).items():
        node = f"the output of node {shown(node_id)} in {where}"
        for image in optional(require(output, dict, node), "images", list, node):
            image = require(image, dict, f"an image in {node}")
            image_file_name(image.get("filename"), node)
            optional(image, "subfolder", str, f"an image in {node}")
            optional(image, "type", str, f"an image in {node}")
    return record


def image_file_name(name, where: str) -> str:
    """The name an image from the server is saved under: the last part of its file name
    ('../../a.png' -> 'a.png'). ServerAnswerError for a name with no usable last part ('', '.', '..',
    'dir/'), one with a backslash, a NUL or another control character, or one too long."""
    name = require(name, str, f"an image's filename in {where}")
    last = name.rsplit("/", 1)[-1]
    if last in ("", ".", "..") or "\\" in last or not last.isprintable() or len(last.encode()) > MAX_NAME_BYTES:
        raise ServerAnswerError(f"the server sent an image named {shown(name)} in {where}: not a file name "
                                "kiln can save an image under")
    return last


def node_definitions(answer) -> dict:
    """/object_info's answer, checked to have the shape workflow.py reads: {class name: {"input":
    {"required" or "optional": {input name: [type or options, ...]}, "hidden": {...}}, "input_order":
    {section: [input name, ...]}, "output": [...], "display_name": text}}. ServerAnswerError names the
    node and the part that is not."""
    definitions = require(answer, dict, "/object_info's answer")
    for name, info in definitions.items():
        where = f"node {shown(name)} in /object_info's answer"
        info = require(info, dict, where)
        for section, inputs in optional(info, "input", dict, where).items():
            inputs = require(inputs, dict, f"inputs {shown(section)} of {where}")
            if section not in ("required", "optional"):
                continue  # "hidden": input name -> a string such as "PROMPT"
            for input_name, spec in inputs.items():
                if not (isinstance(spec, list) and spec):
                    raise ServerAnswerError(f"the server sent input {shown(input_name)} of {where} as "
                                            f"{shown(spec)}, not a list [type or options, ...]")
        for section, names in optional(info, "input_order", dict, where).items():
            names = require(names, list, f"input_order {shown(section)} of {where}")
            if not all(isinstance(input_name, str) for input_name in names):
                raise ServerAnswerError(f"the server sent input_order {shown(section)} of {where} with a name "
                                        f"that is not a string: {shown(names)}")
        optional(info, "output", list, where)
        optional(info, "display_name", str, where)  # a converted UI workflow's node titles come from it
    return definitions


def _read_answer(response, path: str, limit: int = MAX_ANSWER_BYTES) -> bytes:
    """A whole answer's body; ServerAnswerError if it is cut short or longer than `limit` bytes,
    ServerTooSlow if it does not come within the request's deadline (its socket's)."""
    try:
        body = response.read(limit + 1)
    except TimeoutError as exc:
        raise _too_slow(path, exc) from None
    except (http.client.HTTPException, OSError) as exc:  # IncompleteRead, a chunk cut off, a reset
        raise ServerAnswerError(f"the server sent {path}'s answer cut short ({_why(exc)})") from None
    if len(body) > limit:
        raise ServerAnswerError(f"the server sent {path}'s answer longer than {limit} bytes")
    _check_complete(response, path, len(body))
    return body


def _copy_answer(response, file, path: str) -> None:
    """Write an answer's body to `file` as it comes; ServerAnswerError if it is cut short or longer
    than MAX_IMAGE_BYTES (a server cannot fill the disk), ServerTooSlow past the request's deadline."""
    copied = 0
    while True:
        try:
            chunk = response.read(2**20)
        except TimeoutError as exc:
            raise _too_slow(path, exc) from None
        except (http.client.HTTPException, OSError) as exc:
            raise ServerAnswerError(f"the server sent {path}'s answer cut short ({_why(exc)})") from None
        if not chunk:
            break
        copied += len(chunk)
        if copied > MAX_IMAGE_BYTES:
            raise ServerAnswerError(f"the server sent {path} an answer of more than {MAX_IMAGE_BYTES} bytes")
        file.write(chunk)
    _check_complete(response, path, copied)


def _check_complete(response, path: str, got: int) -> None:
    # http.client's read(n) returns what came before the connection ended without complaint; the
    # bytes its Content-Length announced and that never came are left in .length
    missing = getattr(response, "length", None)
    if missing:
        raise ServerAnswerError(f"the server sent {path}'s answer cut short ({got} bytes of the {got + missing} "
                                "it announced)")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shown(str(exc))}"


# ---------------------------------------------------------------------------------------------------
# a deadline on each request: a server that sends a byte now and then must not hold the client forever

class DeadlinePassed(TimeoutError):
    """A request's time ran out while its answer was still coming."""


class Deadline:
    """The time a request must be done by (time.monotonic() + `seconds`)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def wait(self) -> float:
        """How long the next read (or send, or connect) may wait: the time left, at most READ_WAIT_SECONDS.
        DeadlinePassed when no time is left."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.passed()
        return min(left, READ_WAIT_SECONDS)

    def passed(self) -> DeadlinePassed:
        return DeadlinePassed(f"not all of it came within {self.seconds:g}s, the client's timeout")


class _UntilDeadline:
    """A socket whose every read and send waits only until its deadline (self.deadline, a Deadline, set
    after it is made), so that no number of slow reads together outlasts it: http.client reads the head,
    each chunk's size line and the body through recv_into."""

    deadline: Optional[Deadline] = None

    def _waiting(self, operation, *args, **kwargs):
        if self.deadline is None:
            return operation(*args, **kwargs)
        wait = self.deadline.wait()
        self.settimeout(wait)
        try:
            return operation(*args, **kwargs)
        except TimeoutError:
            if wait < READ_WAIT_SECONDS:  # the deadline was the limit, not READ_WAIT_SECONDS of silence
                raise self.deadline.passed() from None
            raise

    def recv_into(self, *args, **kwargs):
        return self._waiting(super().recv_into, *args, **kwargs)

    def sendall(self, *args, **kwargs):
        return self._waiting(super().sendall, *args, **kwargs)


class _DeadlineSocket(_UntilDeadline, socket.socket):
    pass


class _DeadlineSSLSocket(_UntilDeadline, ssl.SSLSocket):
    pass


def _connect(deadline: Deadline, address, timeout=None, source_address=None) -> _DeadlineSocket:
    """A connection to `address` (http.client's _create_connection) whose reads keep to `deadline`."""
    sock = socket.create_connection(address, deadline.wait(), source_address)
    deadline_sock = _DeadlineSocket(fileno=sock.detach())
    deadline_sock.settimeout(deadline.wait())
    deadline_sock.deadline = deadline
    return deadline_sock


class _DeadlineHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, deadline: Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        # the one hook http.client has for how connect() makes its socket (an attribute since Python 3.2;
        # tests/client/test_comfy.py's trickling servers fail without it)
        self._create_connection = functools.partial(_connect, deadline)


class _DeadlineHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args, deadline: Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self._create_connection = functools.partial(_connect, deadline)

    def connect(self):
        super().connect()  # the TLS handshake waits at most the plain socket's timeout: deadline.wait()
        self.sock.deadline = self.deadline


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_DeadlineHTTPConnection, req, deadline=self.deadline)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline):
        super().__init__(context=_tls_context())  # given: Python 3.12's handler would make one per request
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_DeadlineHTTPSConnection, req, context=self._context, deadline=self.deadline)


@functools.lru_cache(maxsize=None)
def _tls_context() -> ssl.SSLContext:
    """The default verifying TLS context (made once: it loads the system's certificates), its sockets
    keeping to their request's deadline."""
    context = ssl.create_default_context()
    context.sslsocket_class = _DeadlineSSLSocket
    return context


def _too_slow(path: str, exc: TimeoutError) -> ServerTooSlow:
    why = str(exc) if isinstance(exc, DeadlinePassed) else f"nothing came for {READ_WAIT_SECONDS:g}s"
    return ServerTooSlow(f"the server was too slow answering {path}: {why}")


def _create_new_file(folder: Path, name: str):
    """(path, file open for writing) of a file made new in `folder` under `name`, or name-1.png,
    name-2.png, ... when the name is taken (by a file, a folder or a symbolic link, which is never
    followed). ComfyError when MAX_NAME_TRIES names are all taken, or the folder cannot be written."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    stem, suffix = Path(name).stem, Path(name).suffix
    for number in range(MAX_NAME_TRIES):
        path = folder / (f"{stem}-{number}{suffix}" if number else name)
        try:
            return path, os.fdopen(os.open(path, flags, 0o666), "wb")
        except FileExistsError:
            continue
        except OSError as exc:
            raise ComfyError(f"cannot save image {name} in {folder}: {exc.strerror or exc}") from None
    raise ComfyError(f"cannot save image {name} in {folder}: {name} and {stem}-1{suffix} to "
                     f"{stem}-{MAX_NAME_TRIES - 1}{suffix} are all taken")


def _rejection(detail: str) -> str:
    """What ComfyUI's answer to a refused prompt (HTTP 400) says: its error, and each node's errors
    (at most MAX_ERROR_LINES), each field cut to MAX_ERROR_FIELD characters without control characters."""
    try:
        answer = json.loads(detail)
    except (ValueError, RecursionError):
        return f"ComfyUI rejected the prompt: {printable(detail, MAX_ERROR_FIELD)}"
    where = "/prompt's rejection"
    answer = require(answer, dict, where)
    error = answer.get("error")
    if not isinstance(error, str):  # ComfyUI sends {"message", "details", ...}; older servers a line of text
        error = optional(answer, "error", dict, where)
        error = f"{_field(error.get('message', ''))} {_field(error.get('details', ''))}"
    lines = [f"ComfyUI rejected the prompt: {_field(error)}".strip()]
    for node, info in optional(answer, "node_errors", dict, where).items():
        info = require(info, dict, f"node {shown(node)}'s errors in {where}")
        for problem in optional(info, "errors", list, f"node {shown(node)}'s errors in {where}"):
            problem = require(problem, dict, f"an error of node {shown(node)} in {where}")
            lines.append(f"  node {_field(node)} ({_field(info.get('class_type'))}): {_field(problem.get('message'))}: "
                         f"{_field(problem.get('details'))}")
    more = len(lines) - 1 - MAX_ERROR_LINES
    cut = [f"  ... and {more} more node error(s) not shown"] if more > 0 else []
    return "\n".join(lines[:1 + MAX_ERROR_LINES] + cut)


def _field(value) -> str:
    """One field of a rejection as it may go on the terminal."""
    return printable(value, MAX_ERROR_FIELD)


def _execution_error(status: dict) -> str:
    for kind, data in status.get("messages") or []:
        if kind in ("execution_error", "execution_interrupted"):
            return execution_error_text(kind, data)
    return "see the server's log"


def execution_error_text(kind: str, data: dict) -> str:
    """What an execution_error or execution_interrupted message says, naming the node; the server's
    text line by line without control characters (at most MAX_ERROR_LINES lines, then how many more)."""
    node = printable(f"node {data.get('node_id')} ({data.get('node_type')})")
    if kind == "execution_interrupted":
        return f"interrupted on the server at {node}"
    lines = str(data.get("exception_message", "")).strip().splitlines()
    more = [f"... and {len(lines) - MAX_ERROR_LINES} more line(s)"] if len(lines) > MAX_ERROR_LINES else []
    message = "\n".join([printable(line, 1000) for line in lines[:MAX_ERROR_LINES]] + more)
    return f"{node}: {printable(data.get('exception_type'))}: {message}"


LATENT_NODES = ("EmptyLatentImage", "EmptySD3LatentImage")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'512x512, 768x512:2' -> [(512, 512, 1), (768, 512, 2)] (width x height in pixels, :batch)."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        size, _, batch = item.partition(":")
        try:
            width, height = (int(v) for v in size.lower().split("x"))
            shapes.append((width, height, int(batch or 1)))
        except ValueError:
            raise ValueError(f"shape {item!r}: use WIDTHxHEIGHT or WIDTHxHEIGHT:BATCH, e.g. 1024x1024:2") from None
    if not shapes:
        raise ValueError("no shapes given: e.g. --shapes 512x512,768x768:2")
    return shapes


def apply_sets(prompt: dict, sets: list[str]) -> dict:
    """A copy of an API-format prompt with NODE.INPUT=VALUE settings applied (VALUE read as JSON, else text)."""
    out = json.loads(json.dumps(prompt))
    for item in sets:
        target, _, raw = item.partition("=")
        node, _, name = target.partition(".")
        if not _ or not name or node not in out:
            raise ValueError(f"--set {item!r}: use NODE.INPUT=VALUE with a node id of the workflow "
                             f"({listing(sorted(out), 50)})")
        inputs = out[node].get("inputs") if isinstance(out[node], dict) else None
        if not isinstance(inputs, dict):
            raise ValueError(f"--set {item!r}: workflow node {node} has no 'inputs' (a JSON object) to set {name} in")
        inputs[name] = parse_value(raw)
    return out


def parse_value(raw: str):
    """A command-line value: JSON (7, 7.5, true, "text", [..]) if it parses, else the text itself."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def with_shape(prompt: dict, width: int, height: int, batch: int, steps: Optional[int]) -> dict:
    """A copy of an API-format prompt that renders at (width, height, batch), with `steps` sampling
    steps, and previews instead of saving."""
    if not isinstance(prompt, dict) or "nodes" in prompt:
        raise ValueError("this is a UI-format workflow: export it with 'Save (API)' (ComfyUI's API format)")
    out = json.loads(json.dumps(prompt))
    latents = [node for node in out.values() if node.get("class_type") in LATENT_NODES]
    if not latents:
        raise ValueError(f"the workflow has no {' or '.join(LATENT_NODES)} node to set the size on")
    for node in latents:
        node["inputs"].update(width=width, height=height, batch_size=batch)
    for node in out.values():
        if steps is not None and "steps" in node.get("inputs", {}) and "Sampler" in node.get("class_type", ""):
            node["inputs"]["steps"] = steps
        if node.get("class_type") == "SaveImage":
            node["class_type"] = "PreviewImage"
            node["inputs"].pop("filename_prefix", None)
    return out
