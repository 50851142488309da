"""How Kiln's cache is used: where it lives, use/refresh/off, and its size cap."""
from __future__ import annotations

import math
import os
import reprlib
from dataclasses import dataclass
from typing import Any, Mapping

from . import location
from .location import default_cache_dir
from .store import CacheStore

CACHE_MODES = ("use", "refresh", "off")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FIELDS = ("dir", "mode", "max_gb")


class CacheOptionsError(ValueError):
    """A cache setting is invalid; the message names it and what is allowed."""


@dataclass(frozen=True)
class CacheOptions:
    """dir: the cache directory ("" = default_cache_dir()); never inside Kiln's own folder.
    mode: "use": load a matching entry instead of compiling, and store one when none matches;
        "refresh": ignore stored entries, compile and replace the entry; "off": neither read nor write.
    max_gb: the directory's size cap; least recently used entries are evicted past it.
    within: the directories `dir` must lie under (ComfyUI's nodes: ComfyUI's user directory and
        KILN_CACHE_DIR, since a workflow names it); empty: anywhere. A directory outside them is
        not an error here: the model compiles without the cache and says why (`open`)."""

    dir: str = ""
    mode: str = "use"
    max_gb: float = 20.0
    within: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.dir, str):
            raise CacheOptionsError(f"cache dir={reprlib.repr(self.dir)}: give a directory path (text)")
        if self.mode not in CACHE_MODES:
            raise CacheOptionsError(f"cache mode {reprlib.repr(self.mode)}: use one of {', '.join(CACHE_MODES)}")
        if (not isinstance(self.max_gb, (int, float)) or isinstance(self.max_gb, bool) or not math.isfinite(self.max_gb)
                or self.max_gb <= 0):
            raise CacheOptionsError(f"cache max_gb={reprlib.repr(self.max_gb)}: use a positive, finite number of GiB")
        root = self.root
        if root == _PACKAGE or root.startswith(_PACKAGE + os.sep):
            raise CacheOptionsError(f"cache dir {root} is inside Kiln's own folder ({_PACKAGE}); updates would replace "
                                    "it and it would travel with the code: choose a directory outside it")

    @property
    def named(self) -> str:
        """The directory as given (absolute), before links are resolved."""
        return os.path.abspath(os.path.expanduser(self.dir or default_cache_dir()))

    @property
    def root(self) -> str:
        """The directory's real path: what Kiln opens."""
        return location.resolve(self.named)

    @property
    def max_bytes(self) -> int:
        return int(self.max_gb * 1024 ** 3)

    def open(self) -> CacheStore:
        """The cache directory, checked: CacheLocationError if it lies outside `within`,
        CacheTrustError if it cannot be trusted, OSError if it cannot be made."""
        if self.within:
            location.check_within(self.named, self.within)
        return CacheStore(self.root, self.max_bytes)

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
            raise CacheOptionsError(f"cache: expected a directory or a mapping with {', '.join(_FIELDS)}; got "
                                    f"{reprlib.repr(value)}")
        unknown = sorted(map(str, set(value) - set(_FIELDS)))
        if unknown:
            raise CacheOptionsError(f"cache: unknown key(s) {', '.join(map(reprlib.repr, unknown))}; allowed: "
                                    f"{', '.join(_FIELDS)}")
        return cls(**dict(value))
