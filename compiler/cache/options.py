"""How Kiln's cache is used: where it lives, use/refresh/off, and its size cap."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ... import choices
from ..options.option_text import check_keys, shorten
from . import location
from .location import default_cache_dir
from .store import CacheStore

CACHE_MODES = tuple(choices.CACHE_MODES)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # real: a linked install too
_FIELDS = ("dir", "mode", "max_gb")
MAX_GB = 1024.0 ** 2        # a PiB: past it the number is a typo, not a disk
MAX_PATH_CHARS = 4096       # PATH_MAX on Linux


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
        if (not isinstance(self.dir, str) or "\0" in self.dir or len(self.dir) > MAX_PATH_CHARS
                or not _encodable(self.dir)):
            raise CacheOptionsError(f"cache dir={shorten(self.dir)}: give a directory path (text of at most "
                                    f"{MAX_PATH_CHARS} characters that the file system can take, no NUL)")
        if not isinstance(self.mode, str) or self.mode not in CACHE_MODES:
            raise CacheOptionsError(f"cache mode {shorten(self.mode)}: use one of {', '.join(CACHE_MODES)}")
        if (not isinstance(self.max_gb, (int, float)) or isinstance(self.max_gb, bool)
                or not 0 < self.max_gb <= MAX_GB or not math.isfinite(self.max_gb)):
            raise CacheOptionsError(f"cache max_gb={shorten(self.max_gb)}: use a number of GiB above 0 and at "
                                    f"most {MAX_GB:g}")
        root = self.root
        if root == _PACKAGE or root.startswith(_PACKAGE + os.sep):
            raise CacheOptionsError(f"cache dir {shorten(root)} is inside Kiln's own folder ({_PACKAGE}); updates "
                                    "would replace it and it would travel with the code: choose a directory outside it")

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
                                    f"{shorten(value)}")
        check_keys(value, _FIELDS, "cache", CacheOptionsError)
        return cls(**dict(value))


def _encodable(path: str) -> bool:
    """Whether the file system can be given `path` (a lone surrogate from JSON cannot)."""
    try:
        os.fsencode(path)
    except UnicodeError:
        return False
    return True
