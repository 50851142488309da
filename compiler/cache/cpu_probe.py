"""Inductor's probe of the CPU's vector instruction sets, kept in Kiln's cache.

Before its first CPU kernel in a process, Inductor builds a test program per vector instruction set
the CPU reports (AMX, AVX-512 VNNI, AVX-512, AVX2: 6-12 s on a 2-core CPU one after another, 6 s
side by side as Kiln runs them, compat.detect_cpu_vector_isa) into its cache directory, loads each
in a child process and keeps the answer for the process. A process that starts with an
empty Inductor cache directory (after a reboot, a cleaned /tmp, in a fresh container) builds them
all again: most of a warm start from Kiln's cache. So Kiln runs the probe in a folder of its own,
keeps the programs as a signed entry, and in a later process writes them back there first: Inductor
finds them built and only loads each. Inductor's own names still decide (they hash the program, the
flags and the compiler), so after a compiler change it builds afresh and the entry is replaced.
"""
from __future__ import annotations

import logging
import time

from .. import compat
from .key import entry_key, environment_fields
from .store import CacheStore, Entry, error_text, read_files, read_or_refuse, write_files
from .trust import CacheError

log = logging.getLogger("kiln")

LABEL = "Inductor's CPU instruction-set probe"


def probe_fields() -> dict:
    """The entry's key fields: the machine, torch and Python; not Kiln's version, so a Kiln update
    keeps them (the programs are Inductor's, and an entry that is new here builds them once more, even
    where Inductor's own cache directory had them)."""
    environment = environment_fields("cpu")
    return {"cpu_probe": "vector instruction sets", **{name: environment[name] for name in ("device", "torch", "python")},
            "label": LABEL}


def detect_cpu_vector_isa(store: CacheStore, use_stored: bool = True) -> None:
    """Let Inductor probe the CPU now (once a process), its test programs taken from `store` (unless
    `use_stored` is False: the cache's refresh mode) and kept there. Nothing here stops a compile: an
    entry that cannot be read or stored only costs the probe its ~6 s, said in the log."""
    if compat.cpu_vector_isa_detected():
        return
    fields = probe_fields()
    key = entry_key(fields)
    entry, reason = read_or_refuse(store, key, "probing the CPU afresh") if use_stored else (None, "")
    if reason:
        log.info("Kiln: %s: no stored programs (%s)", LABEL, reason)
    start = time.perf_counter()
    try:
        work = store.work_dir()
        if entry is not None:
            write_files(work, entry.files)
    except (CacheError, OSError) as exc:
        log.info("Kiln: %s runs without Kiln's cache (%s)", LABEL, error_text(exc))
        compat.detect_cpu_vector_isa()
        return
    with compat.inductor_cache_dir(work):
        compat.detect_cpu_vector_isa()
    seconds = time.perf_counter() - start
    try:
        files = read_files(work)
        if entry is not None and set(files) <= set(entry.files):
            log.info("Kiln: %s loaded its test programs from Kiln's cache (%.1fs)", LABEL, seconds)
            return
        store.write(Entry(key=key, fields=fields, files=files, compile_seconds=seconds))
        log.info("Kiln: %s built its test programs in %.1fs and stored them in Kiln's cache%s", LABEL, seconds,
                 "" if entry is None else " (the stored ones were for another compiler or torch)")
    except (CacheError, OSError) as exc:
        log.info("Kiln: %s: its test programs were not stored (%s)", LABEL, error_text(exc))

