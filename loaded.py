"""Kiln's compiler, imported once and guarded: if it cannot load (a torch too old for it, a broken
install), `import kiln` and ComfyUI's start-up still work, and Kiln's nodes pass models through,
saying why (COMPILER_LOAD_ERROR) in their report."""
import logging

try:
    from . import compiler
    COMPILER_LOAD_ERROR = ""
except Exception as _exc:  # noqa: BLE001  a broken or too-old torch must not break ComfyUI's start-up
    compiler = None
    COMPILER_LOAD_ERROR = f"Kiln's compiler could not load ({type(_exc).__name__}: {_exc})"
    logging.getLogger("kiln").error("%s; Kiln nodes will pass models through eagerly", COMPILER_LOAD_ERROR)

__all__ = ["compiler", "COMPILER_LOAD_ERROR"]
