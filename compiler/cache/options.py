"""How Kiln's cache is used: where it lives, use/refresh/off, and its size cap."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

CACHE_MODES = ("use", "refresh", "off")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CacheOptionsError(ValueError):
    """A cache setting is invalid; the message names it and what is allowed."""


def default_cache_dir() -> str:
    """The user's cache directory: $XDG_CACHE_HOME/kiln, ~/.cache/kiln, or %LOCALAPPDATA%\\kiln on Windows.
    (ComfyUI's Cache Graph node uses ComfyUI's user directory instead.)"""
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        return os.path.join(os.environ["LOCALAPPDATA"], "kiln", "cache")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


@dataclass(frozen=True)
class CacheOptions:
    """dir: the cache directory ("" = default_cache_dir()); never inside Kiln's own folder.
    mode: "use": load a matching entry instead of compiling, and store one when none matches;
        "refresh": ignore stored entries, compile and replace the entry; "off": neither read nor write.
    max_gb: the directory's size cap; least recently used entries are evicted past it."""

    dir: str = ""
    mode: str = "use"
    max_gb: float = 20.0

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise CacheOptionsError(f"cache mode {self.mode!r}: use one of {', '.join(CACHE_MODES)}")
        if not isinstance(self.max_gb, (int, float)) or isinstance(self.max_gb, bool) or self.max_gb <= 0:
            raise CacheOptionsError(f"cache max_gb={self.max_gb!r}: use a positive number of GiB")
        root = self.root
        if root == _PACKAGE or root.startswith(_PACKAGE + os.sep):
            raise CacheOptionsError(f"cache dir {root} is inside Kiln's own folder ({_PACKAGE}); updates would replace "
                                    "it and it would travel with the code: choose a directory outside it")

    @property
    def root(self) -> str:
        return os.path.abspath(os.path.expanduser(str(self.dir) or default_cache_dir()))

    @property
    def max_bytes(self) -> int:
        return int(self.max_gb * 1024 ** 3)

    def as_dict(self) -> dict:
        return {"dir": self.root, "mode": self.mode, "max_gb": self.max_gb}

    @classmethod
    def from_mapping(cls, value: "CacheOptions | Mapping[str, Any] | str | None") -> "CacheOptions":
        """From a mapping (YAML `cache: {dir: ..., mode: use, max_gb: 20}`) or a directory string."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(dir=value)
        if not isinstance(value, Mapping):
            raise CacheOptionsError(f"cache: expected a directory or a mapping with dir, mode, max_gb; got {type(value).__name__}")
        unknown = sorted(set(value) - {"dir", "mode", "max_gb"})
        if unknown:
            raise CacheOptionsError(f"cache: unknown key(s) {', '.join(map(repr, unknown))}; allowed: dir, mode, max_gb")
        return cls(**dict(value))
