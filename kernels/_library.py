"""Registering Kiln's kernels as torch.library custom ops, and finding Triton.

Triton is optional: every op has a pure-torch reference that runs wherever Triton can't.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

log = logging.getLogger("kiln")
NAMESPACE = "kiln"
_warned: set = set()


def log_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True if Triton imports (it is looked for once, lazily, never at Kiln's import)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install)
        log.info("Kiln: Triton unavailable (%s); Kiln kernels run their torch references", exc)
        return False
    return True


def use_triton(x: torch.Tensor, op: str) -> bool:
    """Run the Triton kernel for this tensor? Only on CUDA with Triton; says once when it can't."""
    if x.device.type != "cuda":
        return False
    if not triton_available():
        log_once(op, f"Triton is not installed: kiln::{op} runs its pure-torch reference (slower)")
        return False
    return True


def define_op(name: str, fn: Callable, fake: Callable, mutates_args=()):
    """`torch.library.custom_op("kiln::<name>")` with a fake impl; reuses an existing registration.

    The pack can be imported twice in one process (as `kiln` and under ComfyUI's folder name);
    the op is then already defined by the first copy and is reused, not redefined.
    """
    existing = getattr(getattr(torch.ops, NAMESPACE), name, None)
    if existing is not None:
        log.debug("Kiln: %s::%s already registered; reusing it", NAMESPACE, name)
        return existing
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)
    op.register_fake(fake)
    return op
