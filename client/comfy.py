"""A client for a running ComfyUI's HTTP API, standard library only (never imports ComfyUI).

`kiln queue` submits prompts, reads their history and downloads their images with it; `kiln warm`
queues a workflow at each resolution and batch size ahead of time.
"""
from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional


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


class ComfyClient:
    def __init__(self, server: str = "http://127.0.0.1:8188", timeout: float = 3600.0):
        self.server = server.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex

    def _open(self, path: str, body: Optional[dict] = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if path == "/prompt":
                raise PromptRejected(_rejection(detail)) from None
            raise ComfyError(f"{self.server}{path}: HTTP {exc.code}: {detail[:500]}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ComfyUnreachable(f"cannot reach ComfyUI at {self.server} ({getattr(exc, 'reason', exc)}): "
                                   "is it running?") from None

    def _request(self, path: str, body: Optional[dict] = None) -> Any:
        with self._open(path, body) as response:
            try:
                return json.loads(response.read() or b"null")
            except ValueError:
                raise ComfyError(f"{self.server}{path} did not answer JSON: is this a ComfyUI server?") from None

    def object_info(self) -> dict:
        """The server's node definitions: {class name: {input, input_order, output, ...}}."""
        return self._request("/object_info")

    def submit(self, prompt: dict) -> str:
        """Queue an API-format prompt; its prompt id. PromptRejected with the node errors if refused."""
        answer = self._request("/prompt", {"prompt": prompt, "client_id": self.client_id})
        return answer["prompt_id"]

    def history(self, prompt_id: str) -> Optional[dict]:
        """A prompt's history record once it has finished (or failed); None before."""
        record = (self._request(f"/history/{prompt_id}") or {}).get(prompt_id)
        if record and record.get("status", {}).get("completed") is not None:
            return record
        return None

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
        through GET /view; its path."""
        query = urllib.parse.urlencode({"filename": image["filename"], "subfolder": image.get("subfolder", ""),
                                        "type": image.get("type", "output")})
        path = Path(folder) / Path(image["filename"]).name  # the server's name, never a path it chose
        with self._open(f"/view?{query}") as response, open(path, "wb") as f:
            shutil.copyfileobj(response, f)
        return path

    def websocket_url(self) -> str:
        """ws(s)://HOST:PORT/ws?clientId=<this client's id>: the server's messages about our prompts."""
        parts = urllib.parse.urlsplit(self.server)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}{parts.path}/ws?clientId={self.client_id}"


def check_record(prompt_id: str, record: dict) -> dict:
    """A finished prompt's history record; PromptFailed if it says the prompt failed."""
    status = record.get("status", {})
    if status.get("status_str") == "error":
        raise PromptFailed(f"prompt {prompt_id} failed: {_execution_error(status)}")
    return record


def output_images(record: dict) -> list[dict]:
    """The images ({filename, subfolder, type}) a history record lists, by output node."""
    outputs = record.get("outputs") or {}
    return [image for node_id in sorted(outputs, key=lambda k: (len(k), k))
            for image in outputs[node_id].get("images") or []]


def _rejection(detail: str) -> str:
    try:
        answer = json.loads(detail)
    except ValueError:
        return f"ComfyUI rejected the prompt: {detail[:500]}"
    error = answer.get("error", {})
    lines = [f"ComfyUI rejected the prompt: {error.get('message', '')} {error.get('details', '')}".strip()]
    for node, info in (answer.get("node_errors") or {}).items():
        for problem in info.get("errors", []):
            lines.append(f"  node {node} ({info.get('class_type')}): {problem.get('message')}: {problem.get('details')}")
    return "\n".join(lines)


def _execution_error(status: dict) -> str:
    for kind, data in status.get("messages", []):
        if kind in ("execution_error", "execution_interrupted"):
            return execution_error_text(kind, data)
    return "see the server's log"


def execution_error_text(kind: str, data: dict) -> str:
    """What an execution_error or execution_interrupted message says, naming the node."""
    node = f"node {data.get('node_id')} ({data.get('node_type')})"
    if kind == "execution_interrupted":
        return f"interrupted on the server at {node}"
    return f"{node}: {data.get('exception_type')}: {str(data.get('exception_message', '')).strip()}"


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
            raise ValueError(f"--set {item!r}: use NODE.INPUT=VALUE with a node id of the workflow ({', '.join(sorted(out))})")
        out[node]["inputs"][name] = parse_value(raw)
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
