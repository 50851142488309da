"""A client for a running ComfyUI's HTTP API, standard library only (never imports ComfyUI).

`kiln warm` uses it to queue a workflow at each resolution and batch size ahead of time.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Optional


class ComfyError(RuntimeError):
    """The server is unreachable, rejected a prompt, or a prompt failed; the message says which."""


class ComfyClient:
    def __init__(self, server: str = "http://127.0.0.1:8188", timeout: float = 3600.0):
        self.server = server.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex

    def _request(self, path: str, body: Optional[dict] = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ComfyError(_rejection(detail) if path == "/prompt" else f"{self.server}{path}: HTTP {exc.code}: {detail[:500]}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ComfyError(f"cannot reach ComfyUI at {self.server} ({getattr(exc, 'reason', exc)}): is it running?") from None

    def submit(self, prompt: dict) -> str:
        """Queue an API-format prompt; its prompt id."""
        answer = self._request("/prompt", {"prompt": prompt, "client_id": self.client_id})
        return answer["prompt_id"]

    def wait(self, prompt_id: str, poll: float = 0.5) -> dict:
        """Wait for a prompt to finish; its history record. ComfyError if it failed or timed out."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            history = self._request(f"/history/{prompt_id}")
            record = (history or {}).get(prompt_id)
            if record and record.get("status", {}).get("completed") is not None:
                status = record["status"]
                if status.get("status_str") == "error":
                    raise ComfyError(f"prompt {prompt_id} failed: {_execution_error(status)}")
                return record
            time.sleep(poll)
        raise ComfyError(f"prompt {prompt_id} did not finish within {self.timeout:.0f}s")


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
        if kind == "execution_error":
            return f"node {data.get('node_id')} ({data.get('node_type')}): {data.get('exception_type')}: {data.get('exception_message', '').strip()}"
    return "see the server's log"


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
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[node]["inputs"][name] = value
    return out


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
