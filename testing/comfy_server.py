"""A ComfyUI server started for one run, on a CPU: its own base directory (Kiln linked in as a custom node
pack, the model files linked from where they are), its own port and environment, stopped after.

For benchmarks that must start each variant cold (a fresh Inductor cache per server) and for tests.
Nothing here deletes a file: the caller owns the base directory.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping, Optional

REPO = Path(__file__).resolve().parents[1]


def make_base_dir(base: Path, models: Mapping[str, Mapping[str, Path]], pack: Path = REPO) -> None:
    """`base` as a ComfyUI base directory: Kiln (this tree, or the Kiln tree `pack`) as the custom node
    pack comfyui-kiln, and models/<folder>/<name> linked to each file in `models` ({folder: {name: file}})."""
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / "comfyui-kiln").symlink_to(Path(pack).resolve(), target_is_directory=True)
    (base / "input").mkdir(exist_ok=True)
    for folder, files in models.items():
        for name, target in files.items():
            link = base / "models" / folder / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(target).resolve())


def headless_front_end(comfyui: Path, python: str) -> list:
    """["--front-end-root", <comfyui>/web] where `python` lacks ComfyUI's frontend package and the tree has an
    empty web/ to serve instead (a ComfyUI bundle for a machine without network access: benchmarks/comfy_bundle.py;
    without either, ComfyUI exits at start); [] elsewhere."""
    web = Path(comfyui) / "web"
    if not web.is_dir():
        return []
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('comfyui_frontend_package') is not None)"
    missing = subprocess.run([python, "-c", probe], cwd=comfyui, capture_output=True).returncode == 0
    return ["--front-end-root", str(web)] if missing else []


@contextlib.contextmanager
def comfy_server(comfyui: Path, base: Path, port: int, python: str = sys.executable,
                 env: Optional[Mapping[str, str]] = None, timeout: float = 240.0) -> Iterator[tuple[str, dict]]:
    """(url, object_info) of ComfyUI at `comfyui` run by `python` on 127.0.0.1:`port` with `base` as
    its base directory and `env` added to the environment; its log is base/server.log. Stopped on exit.
    RuntimeError with the log's end when it does not start or a custom node pack fails to import."""
    log_path = base / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [python, "main.py", "--cpu", "--base-directory", str(base), "--listen", "127.0.0.1", "--port", str(port),
             "--preview-method", "none", "--disable-auto-launch", "--use-pytorch-cross-attention",
             *headless_front_end(comfyui, python)],
            cwd=comfyui, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/object_info/KSampler", timeout=5):
                        break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"ComfyUI did not start: {log_path.read_text()[-3000:]}") from None
                    time.sleep(0.5)
            if "IMPORT FAILED" in log_path.read_text():
                raise RuntimeError(f"a custom node pack failed to import: {log_path.read_text()[-3000:]}")
            with urllib.request.urlopen(f"{url}/object_info", timeout=60) as response:
                yield url, json.load(response)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
