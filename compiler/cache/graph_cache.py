"""One model's use of Kiln's cache: look a lowering up, load it, or lower it and store what it made.

A lowering through Inductor writes everything it produced (AOTAutograd and FX graph cache entries,
generated modules, compiled C++ or Triton kernels) into a fresh private directory; Kiln signs
those files as one entry. On a hit the verified files are written into another fresh directory
and the same lowering runs there: AOTAutograd and Inductor find their own entries (their keys
still decide, so a hit Kiln got wrong would compile, never run stale code) and load instead of
compiling. TorchDynamo's capture and Kiln's passes run in every process (they are what proves
the guards); Inductor's work is what the cache saves. An entry also names the entries the model
stored or loaded before it in that process (NEEDS_FILE), whose kernels it may run: Inductor builds a
kernel once per process, so a load brings those kernels too, whatever order the graphs load in.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..torch_compat import inductor
from . import key as cache_key
from .options import CacheOptions
from .entry import KEY_PATTERN, folders
from .store import CacheEntryError, CacheStore, Entry, error_text, read_files, read_or_refuse, write_files
from .trust import CacheError

log = logging.getLogger("kiln")

NEEDS_FILE = "kiln-needs.json"           # in an entry: the keys of the entries whose kernels it may run
MAX_NEEDS = 256
MAX_NEEDS_BYTES = MAX_NEEDS * 40  # a JSON list of that many 32-digit keys, with room to spare
GRAPH_FOLDERS = ("fxgraph", "aotautograd")  # Inductor's per-graph records: a needed entry's stay with it


@dataclass
class CacheEvent:
    """What the cache did for one lowering."""

    label: str              # "graph 0", "graph 0 static batch 2, 64x64 latent"
    outcome: str            # "hit" | "miss" | "refresh" | "off" | "unavailable"
    reason: str = ""        # why it missed, what was refused, why the cache is unavailable
    key: str = ""
    entry_bytes: int = 0
    seconds_saved: float = 0.0

    def line(self) -> str:
        text = f"cache {self.outcome} for {self.label}"
        if self.outcome == "hit":
            text += f": {self.entry_bytes / 2**20:.1f} MiB entry, {self.seconds_saved:.1f}s of compiling saved"
        elif self.entry_bytes:
            text += f", stored a {self.entry_bytes / 2**20:.1f} MiB entry"
        return text + (f" ({self.reason})" if self.reason else "")


class GraphCache:
    """Kiln's cache as one KilnModel uses it. The store is opened on first use. Whatever goes wrong
    in the cache (a directory that cannot be trusted, made or written, one a workflow may not name,
    a bad entry) makes the model compile without the cache, or without that entry, said once:
    never an eager fallback, never a failed prompt."""

    def __init__(self, options: CacheOptions):
        self.options = options
        self._store: Optional[CacheStore] = None
        self.unavailable = "" if options.mode != "off" else "cache off"
        # the entries this model stored or loaded so far, in order: a later entry needs their kernels
        self._seen: list[str] = []

    def store(self) -> Optional[CacheStore]:
        if self.unavailable:
            return None
        if self._store is None:
            try:
                self._store = self.options.open()
            except (CacheError, OSError) as exc:
                self._disable_for(exc)
        return self._store

    def _disable(self, reason: str) -> None:
        """From now on this model compiles without the cache; the first reason is logged."""
        if not self.unavailable:
            log.warning("Kiln: %s", reason)
            self.unavailable = reason

    def _disable_for(self, exc: Exception) -> None:
        where = f"cannot use the cache directory {self.options.root} ({error_text(exc)})" if isinstance(exc, OSError) else ""
        self._disable(f"{where or exc}; compiling without the cache")

    def lower(self, lower: Callable[[], tuple], fields: dict) -> tuple[Callable, str, CacheEvent]:
        """Run `lower()` (a Lowering.lower call returning (callable, name)) under the cache.
        `fields`: the entry's key fields (cache/key.py entry_fields)."""
        key = cache_key.entry_key(fields)
        label = fields.get("label", "graph")
        store = self.store()
        if store is None:
            return self._without_cache(lower, label, key)
        entry, reason = None, ""
        try:
            if self.options.mode == "use":
                entry, reason = self._lookup(store, key, fields)
            else:
                reason = "refresh: stored entries ignored"
            work = store.work_dir()
            if entry is not None:
                write_files(work, self._with_needed_files(store, entry))
        except (CacheError, OSError) as exc:
            self._disable_for(exc)
            return self._without_cache(lower, label, key)
        if entry is not None:
            return self._lower_from(store, entry, work, lower, label)
        compiled, name, seconds = _lower_in(work, lower)
        outcome = "miss" if self.options.mode == "use" else "refresh"
        return compiled, name, self._store_files(store, key, fields, work, seconds, outcome, reason)

    def _with_needed_files(self, store: CacheStore, entry: Entry) -> dict[str, bytes]:
        """The entry's files, and the kernel files of the entries it needs (NEEDS_FILE): the ones this
        model lowered or loaded before it, in the process that stored it. Inductor builds a kernel once
        per process, into the lowering that first needed it, so a later graph's entry may lack a kernel
        it runs; loaded in another order (a region left eager, a new model) it would be built again.
        A needed file whose name is taken (by a file, or as a folder) is left out: Inductor builds it."""
        files = {name: data for name, data in entry.files.items() if name != NEEDS_FILE}
        taken = {folder for name in files for folder in folders(name)}  # the folders the files lie in
        for key in self._needs(entry):
            try:
                needed = store.read(key)
            except (CacheError, OSError) as exc:
                log.info("Kiln: entry %s needs entry %s, which cannot be read (%s); Inductor builds what it lacks",
                         entry.key, key, exc)
                continue
            if needed is None:
                continue
            self._saw(key)  # only an entry that was read: a missing or damaged one is not handed on
            for name, data in needed.files.items():
                if (name not in files and name not in taken and name != NEEDS_FILE
                        and name.split("/")[0] not in GRAPH_FOLDERS and not any(f in files for f in folders(name))):
                    files[name] = data
                    taken.update(folders(name))
        self._saw(entry.key)
        return files

    def _needs(self, entry: Entry) -> list[str]:
        """The keys in the entry's NEEDS_FILE, read as untrusted data (a bad list is ignored, with a warning)."""
        data = entry.files.get(NEEDS_FILE)
        if data is None:
            return []
        try:
            if len(data) > MAX_NEEDS_BYTES:
                raise ValueError(f"{len(data)} bytes, more than a list of {MAX_NEEDS} keys takes")
            keys = json.loads(data)
            if not (isinstance(keys, list) and len(keys) <= MAX_NEEDS
                    and all(isinstance(k, str) and KEY_PATTERN.fullmatch(k) for k in keys)):
                raise ValueError(f"not a list of at most {MAX_NEEDS} entry keys")
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            log.warning("Kiln: entry %s: ignored its %s (%s)", entry.key, NEEDS_FILE, exc)
            return []
        return keys

    def _saw(self, key: str) -> None:
        if key not in self._seen:
            self._seen.append(key)

    def read_records(self, fields: dict) -> dict[str, bytes]:
        """The files of the entry keyed by `fields`, by name: small records kept beside the graphs (a
        region's measured choice, compiler/regional/region_choice.py; its verdict of nothing to fuse,
        compiler/regional/fusible.py), or none when there is no entry, the cache is not in "use" mode, or the
        entry was refused (removed, said in the log). The bytes are the caller's to validate."""
        store = self.store()
        if store is None or self.options.mode != "use":
            return {}
        entry, _ = self._lookup(store, cache_key.entry_key(fields), fields, explain=False)
        return {} if entry is None else dict(entry.files)

    def write_record(self, fields: dict, name: str, data: bytes) -> None:
        """Store `data` as the file `name` of the entry keyed by `fields` (signed like every entry)."""
        store = self.store()
        if store is None:
            return
        try:
            store.write(Entry(key=cache_key.entry_key(fields), fields=fields, files={name: data}))
        except CacheEntryError as exc:  # this record only
            log.warning("Kiln: %s not stored (%s)", name, exc)
        except (CacheError, OSError) as exc:
            self._disable_for(exc)

    def _without_cache(self, lower, label: str, key: str) -> tuple[Callable, str, CacheEvent]:
        compiled, name = lower()
        off = self.options.mode == "off"
        return compiled, name, CacheEvent(label, "off" if off else "unavailable", "" if off else self.unavailable, key)

    def _lookup(self, store: CacheStore, key: str, fields: dict, explain: bool = True) -> tuple[Optional[Entry], str]:
        entry, reason = read_or_refuse(store, key, "compiling it again")
        if reason:
            return None, reason
        if entry is None:
            if not explain:
                return None, ""
            return None, cache_key.explain_miss(fields, (e.fields for _, e, _ in store.headers() if e is not None))
        return entry, ""

    def _lower_from(self, store: CacheStore, entry: Entry, work: str, lower, label: str):
        """Lower with the entry's files in `work`: Inductor loads instead of compiling."""
        before = inductor.inductor_cache_counts()
        compiled, name, seconds = _lower_in(work, lower)
        after = inductor.inductor_cache_counts()
        if after["fxgraph_cache_miss"] > before["fxgraph_cache_miss"] or after["fxgraph_cache_hit"] == before["fxgraph_cache_hit"]:
            log.warning("Kiln: cache entry %s for %s loaded, but Inductor did not find its graph in it and compiled; "
                        "storing a fresh entry", entry.key, label)
            # what was just compiled is a fresh lowering: store it, and serve it
            event = self._store_files(store, entry.key, entry.fields, work, seconds, "miss",
                                      "the entry loaded but Inductor compiled anyway (its own key differed); entry replaced")
            return compiled, name, event
        saved = max(0.0, entry.compile_seconds - seconds)
        event = CacheEvent(label, "hit", key=entry.key, entry_bytes=entry.size, seconds_saved=saved)
        log.info("Kiln: %s", event.line())
        return compiled, name, event

    def _store_files(self, store: CacheStore, key: str, fields: dict, work: str, seconds: float, outcome: str,
                     reason: str) -> CacheEvent:
        label = fields.get("label", "graph")
        try:
            files = read_files(work)
        except OSError as exc:
            self._disable_for(exc)
            return CacheEvent(label, outcome, f"{reason}; not stored: {error_text(exc)}".lstrip("; "), key)
        if not any(name.startswith("fxgraph/") for name in files):
            event = CacheEvent(label, outcome, f"{reason}; nothing stored: Inductor did not cache this graph "
                                               "(see TORCH_LOGS=+inductor for its bypass reason)".lstrip("; "), key)
            log.warning("Kiln: %s", event.line())
            return event
        # the first entries: a kernel is built into the lowering that first needs it
        needs = [seen for seen in self._seen if seen != key][:MAX_NEEDS]
        if needs:
            files[NEEDS_FILE] = json.dumps(needs).encode()
        entry = Entry(key=key, fields=fields, files=files, compile_seconds=seconds)
        try:
            size = store.write(entry)
        except CacheEntryError as exc:  # this entry only (too large): the cache stays on
            event = CacheEvent(label, outcome, f"{reason}; not stored: {exc}".lstrip("; "), key)
            log.warning("Kiln: %s", event.line())
            return event
        except (CacheError, OSError) as exc:
            self._disable_for(exc)
            return CacheEvent(label, outcome, f"{reason}; not stored: {error_text(exc)}".lstrip("; "), key)
        self._saw(key)
        event = CacheEvent(label, outcome, reason, key, entry_bytes=size)
        log.info("Kiln: %s", event.line())
        return event


def _lower_in(work: str, lower) -> tuple[Callable, str, float]:
    """`lower()` with Inductor's caches on and pointed at `work`; (callable, name, seconds)."""
    start = time.perf_counter()
    with inductor.inductor_persistent_caches(), inductor.inductor_cache_dir(work):
        compiled, name = lower()
    return compiled, name, time.perf_counter() - start
