"""The key of a cache entry: every field that decides whether compiled code may be reused.

An entry is reused only when all fields are equal: the captured graph's structure (its code and
the shapes and dtypes of its weights, never their values: a LoRA or a fine-tune of the same
architecture hits), the shapes and dtypes of its inputs, Kiln's options and shape policy, the
device kind and compute capability, and the versions of Kiln (with a hash of its compiler and
kernel sources), torch, Triton, CUDA and Python. A miss names the fields that differed from the
closest entry of the same graph.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from typing import Any, Iterable, Optional

import torch

from ..options.option_text import flatten

# the part of the package whose code ends up in (or decides) compiled graphs
_SOURCE_DIRS = ("compiler", "kernels")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """A hash of every Python file of Kiln's compiler and kernels: any change to them misses."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digest = hashlib.sha256()
    for folder in _SOURCE_DIRS:
        for here, dirs, files in sorted(os.walk(os.path.join(root, folder))):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".yaml")):
                    path = os.path.join(here, name)
                    with open(path, "rb") as f:
                        digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def kiln_version() -> str:
    try:
        from importlib.metadata import version

        return version("comfyui-kiln")
    except Exception:  # noqa: BLE001  running from a checkout that was never installed
        return "unknown"


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def device_field(device: str) -> str:
    """"cpu (x86_64)" or "cuda sm_90 (NVIDIA H100 80GB HBM3)": what generated code is built for."""
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda sm_{major}{minor} ({torch.cuda.get_device_name()})"
    return f"{device} ({platform.machine()})"


def environment_fields(device: str) -> dict[str, Any]:
    return {
        "device": device_field(device),
        "kiln": f"{kiln_version()} source {source_hash()}",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _tensor_signature(value) -> Any:
    if isinstance(value, torch.Tensor):
        return [[str(s) for s in value.shape], [str(s) for s in value.stride()], str(value.dtype),
                value.device.type, bool(value.requires_grad)]
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym {value}"
    return repr(type(value).__name__)


def graph_hash(gm: torch.fx.GraphModule, is_weight) -> str:
    """The captured graph's structure: its code and its weights' shapes and dtypes (never values)."""
    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "placeholder" and is_weight(node):
            value = node.meta.get("example_value")
            digest.update(f"{node.name}:{_tensor_signature(value)}".encode())
    return digest.hexdigest()[:32]


def input_signature(example_inputs: Iterable) -> str:
    return json.dumps([_tensor_signature(x) for x in example_inputs])


def entry_fields(graph: str, example_inputs: Iterable, options: dict, shape_policy: dict, device: str,
                 label: str) -> dict[str, Any]:
    """All key fields; `label` (e.g. "UNet2DConditionModel graph 0") is shown, not keyed."""
    inputs = input_signature(example_inputs)
    dtypes = sorted({x.dtype for x in example_inputs if isinstance(x, torch.Tensor)}, key=str)
    return {
        "graph": graph,
        "inputs": hashlib.sha256(inputs.encode()).hexdigest()[:16],
        "dtypes": ", ".join(map(str, dtypes)),
        "options": json.loads(json.dumps(options, default=str)),        # plain JSON data, as stored
        "shape_policy": json.loads(json.dumps(shape_policy, default=str)),
        "grad": torch.is_grad_enabled(),
        **environment_fields(device),
        "label": label,
    }


def choice_fields(region_signature: str, inputs: Iterable, options: dict, device: str, label: str) -> dict[str, Any]:
    """Key fields of a region's measured choice (compiler/regional/region_choice.py): the block's signature,
    its inputs' shapes, strides and dtypes, the options that shape its lowering, the environment and,
    on a CPU, the threads the timing ran on; `label` is shown, not keyed."""
    return {
        "region_choice": region_signature,
        "inputs": hashlib.sha256(input_signature(inputs).encode()).hexdigest()[:16],
        "options": json.loads(json.dumps(options, default=str)),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads() if device == "cpu" else None,
        **environment_fields(device),
        "label": label,
    }


_NOT_KEYED = ("label",)


def entry_key(fields: dict[str, Any]) -> str:
    keyed = {name: value for name, value in fields.items() if name not in _NOT_KEYED}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:32]


def differences(wanted: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    """'torch: 2.12.0 -> 2.13.0' for each keyed field that differs (stored -> wanted); nested
    fields by their dotted name ('options.passes.fuse_geglu: unset -> "off"')."""
    wanted, stored = flatten(wanted), flatten(stored)
    names = sorted(name for name in set(wanted) | set(stored) if name.split(".")[0] not in _NOT_KEYED)
    return [f"{name}: {_short(stored.get(name, 'unset'))} -> {_short(wanted.get(name, 'unset'))}" for name in names
            if wanted.get(name, "unset") != stored.get(name, "unset")]


def explain_miss(wanted: dict[str, Any], stored: Iterable[dict[str, Any]]) -> str:
    """Why no entry fits: what differs from the closest entry of the same graph."""
    same_graph = [fields for fields in stored if fields.get("graph") == wanted["graph"]]
    if not same_graph:
        return "no entry for this graph yet (a new model, patch or Kiln version of the graph)"
    closest = min((differences(wanted, fields) for fields in same_graph), key=len)
    return "an entry of this graph differs in " + "; ".join(closest)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
