"""What Kiln's nodes share, so that no node imports another: their widgets (the choices and tooltips
of choices.py), the report of a node that leaves its input eager, and the cache a workflow may use.

The compiler itself is imported once, guarded (loaded.py): a node reads `compiler` (None if it
could not load) and `COMPILER_LOAD_ERROR` from there when it runs.
"""
from __future__ import annotations

import logging
import os

from ..choices import CACHE_MODES, COMPILE_MODES, DEFAULT_MODE, DEFAULT_SCHEME, SCHEMES, tooltip
from . import plan_wrapper

log = logging.getLogger("kiln")

DYNAMIC = {"auto": None, "true": True, "false": False}  # the dynamic widget's choices -> CompileOptions.dynamic


def mode_widget() -> tuple:
    """The compile mode widget: choices.py's modes, each described in the tooltip."""
    return (list(COMPILE_MODES), {"default": DEFAULT_MODE, "tooltip": tooltip(COMPILE_MODES)})


def cache_mode_widget() -> tuple:
    return (list(CACHE_MODES), {"default": "use", "tooltip": tooltip(CACHE_MODES)})


def scheme_widget() -> tuple:
    return (list(SCHEMES), {"default": DEFAULT_SCHEME, "tooltip": tooltip(SCHEMES)})


def eager(thing, reason: str, what: str = ""):
    """(thing, report) for a node that leaves `thing` as it is, the reason logged as a warning:
    'Kiln: the VAE runs eagerly, nothing compiled: why' (`what`: "the VAE"; "" for the model)."""
    report = f"Kiln: {what + ' runs' if what else 'running'} eagerly, nothing compiled: {reason}"
    log.warning(report)
    return (thing, report)


def default_cache_dir() -> str:
    """KILN_CACHE_DIR if the server's owner set it, else kiln-cache in ComfyUI's user directory
    (beside its settings, outside every node pack)."""
    import folder_paths

    from ..compiler import server_cache_dir

    return server_cache_dir() or os.path.join(folder_paths.get_user_directory(), "kiln-cache")


def workflow_cache(cache_dir: str, mode: str, max_gb: float):
    """The cache a workflow asks for. A workflow is untrusted, so its directory is confined to
    ComfyUI's user directory and KILN_CACHE_DIR (a relative name is a folder in the user directory);
    one outside them is not used, and the model compiles without the cache, saying why."""
    import folder_paths

    from ..compiler import CacheOptions, server_cache_dir

    user = folder_paths.get_user_directory()
    named = cache_dir  # not text: CacheOptions refuses it, naming the setting
    if isinstance(cache_dir, str):  # a relative name joins the user directory; an absolute one stays as it is
        named = os.path.join(user, os.path.expanduser(cache_dir.strip()) or default_cache_dir())
    within = (user,) + ((server_cache_dir(),) if server_cache_dir() else ())
    return CacheOptions(dir=named, mode=mode, max_gb=max_gb, within=within)


def show_report(report: str, problem: str, node_id) -> None:
    """Log a node's report; a cache that cannot be used is a warning, shown on the node at once."""
    if problem:
        log.warning(report)
        plan_wrapper.show_text(str(node_id or ""), report)
    else:
        log.info(report)
