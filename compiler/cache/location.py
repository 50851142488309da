"""Where Kiln's cache may live, and where its signing key lives.

    KILN_CACHE_DIR          set by whoever runs the process (a ComfyUI server's owner): the default
                            cache directory, and for ComfyUI the one directory besides ComfyUI's
                            user directory under which a workflow may name a cache directory
    <config home>/kiln/cache-signing.key
                            the per-user key every entry is signed with ($XDG_CONFIG_HOME or
                            ~/.config on Linux and macOS, %APPDATA% on Windows): never in a
                            directory a workflow or a model file can name

A workflow is untrusted input: the directory it names is confined to the directories the server's
owner chose (`check_within`), with no symbolic link below them.
"""
from __future__ import annotations

import os
from typing import Sequence

from .trust import CacheTrustError

ENVIRONMENT_DIR = "KILN_CACHE_DIR"
KEY_FILE = "cache-signing.key"


class CacheLocationError(CacheTrustError):
    """A workflow named a cache directory outside the directories it may use."""


def config_dir() -> str:
    """Kiln's per-user configuration folder (the signing key's home)."""
    if os.name == "nt" and os.environ.get("APPDATA"):
        return os.path.join(os.environ["APPDATA"], "kiln")
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "kiln")


def default_key_path() -> str:
    return os.path.join(config_dir(), KEY_FILE)


def server_cache_dir() -> str:
    """The cache directory the person running this process set (KILN_CACHE_DIR), or ""."""
    return os.path.expanduser(os.environ.get(ENVIRONMENT_DIR, "").strip())


def default_cache_dir() -> str:
    """KILN_CACHE_DIR, else the user's cache directory: $XDG_CACHE_HOME/kiln, ~/.cache/kiln, or
    %LOCALAPPDATA%\\kiln\\cache on Windows. (ComfyUI's Cache Graph node defaults to ComfyUI's user
    directory instead.)"""
    if server_cache_dir():
        return server_cache_dir()
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        return os.path.join(os.environ["LOCALAPPDATA"], "kiln", "cache")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


def resolve(path: str) -> str:
    """The directory's one real path (user and symbolic links expanded), used from then on."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def check_within(path: str, roots: Sequence[str]) -> None:
    """CacheLocationError unless `path` lies under (or is) one of `roots`, with no symbolic link
    between that root and it. `path` is the directory as named, before `resolve`."""
    named = os.path.abspath(os.path.expanduser(path))
    for root in roots:
        base = os.path.abspath(os.path.expanduser(root))
        relative = os.path.relpath(named, base)
        if relative == os.pardir or relative.startswith(os.pardir + os.sep) or os.path.isabs(relative):
            continue
        expected = os.path.normpath(os.path.join(os.path.realpath(base), relative))
        if os.path.realpath(named) != expected:
            raise CacheLocationError(
                f"the cache directory {named} goes through a symbolic link (it leads to {os.path.realpath(named)}): "
                f"a workflow may name a cache directory only under {base}, with no link below it")
        return
    raise CacheLocationError(
        f"the cache directory {named} is outside the directories a workflow may use ({', '.join(roots)}): a workflow "
        f"cannot choose where Kiln writes and loads compiled code. Name a folder under one of them, or, as the person "
        f"running the server, set {ENVIRONMENT_DIR} to the directory you want")
