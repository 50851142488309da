"""Inductor's probe of the CPU's vector instruction sets, kept in Kiln's cache.

Before its first CPU kernel in a process, Inductor builds a test program per vector instruction set
the CPU reports (AMX, AVX-512 VNNI, AVX-512, AVX2: 6-12 s on a 2-core CPU one after another, 6 s
side by side as Kiln runs them, compat.detect_cpu_vector_isa) into its cache directory, loads each
in a child process and keeps the answer for the process. A process that starts with an
empty Inductor cache directory (after a reboot, a cleaned /tmp, in a fresh container) builds them
all again: most of a warm start from Kiln's cache. So Kiln runs the probe in a folder of its own,
keeps the programs as a signed entry, and in a later process writes them back there first: Inductor
finds them built and only loads each (in a thread beside the first capture where they are stored:
GraphCache.ready_cpu_files_ahead; `builds_programs` says where they are not). Inductor's own names
still decide (they hash the program, the flags and the compiler), so after a compiler change it builds
afresh and the entry is replaced.

A process whose probe ran before it first used Kiln's cache (its first CPU compile was an uncached
Kiln one, or torch.compile's) has nothing of it in Kiln's folder. The first time it uses a cache that
lacks the entry (or, in the cache's refresh mode, any cache), Inductor's probe runs once more in a
child process at the lowest priority, into Kiln's folder, while the compile goes on (about 16 s of CPU
on a 2-core machine, one such build at a time: another cache gets the same files once it is done),
and the programs are stored when it ends if the child found at least the instruction sets this
process found, so that the next start finds them. On a CPU kept busy the child can be starved past
Inductor's 60 s limit on loading a program: it then finds fewer, nothing is stored, and the next start
probes in Kiln's folder. A process that exits first stops it and stores nothing.
"""
from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import time
from typing import Optional

from .. import compat
from .key import entry_key, environment_fields
from .store import CacheStore, Entry, error_text, read_files, read_or_refuse, said, write_files
from .trust import CacheError

log = logging.getLogger("kiln")

_looked: set[str] = set()  # the caches (their roots) this process probed with or checked for the entry
_programs: dict[str, bytes] = {}  # the test programs, once this process has them in Kiln's folder
_building: list[threading.Thread] = []  # the background builds this process started (one at a time)
CHILD_SECONDS = 3600  # a probe in a child process (it runs when the CPU is idle) stopped after that: nothing stored
_exiting = False  # the process is exiting: a build stopped now is not a failure to report

LABEL = "Inductor's CPU instruction-set probe"


def probe_fields() -> dict:
    """The entry's key fields: the machine, torch and Python; not Kiln's version, so a Kiln update
    keeps them (the programs are Inductor's, and an entry that is new here builds them once more, even
    where Inductor's own cache directory had them)."""
    environment = environment_fields("cpu")
    return {"cpu_probe": "vector instruction sets", **{name: environment[name] for name in ("device", "torch", "python")},
            "label": LABEL}


def builds_programs(store: CacheStore, use_stored: bool = True) -> bool:
    """Whether `detect_cpu_vector_isa(store, use_stored)` would build Inductor's test programs in this
    process: it has not probed, and `store` holds no programs for it (or is not to be read). Those are
    compiler runs on every core of a small CPU, not work to put beside a capture."""
    if compat.cpu_vector_isa_detected() or not compat.cpu_probe_builds_programs():
        return False
    return not (use_stored and os.path.isfile(store.path(entry_key(probe_fields()))))


def detect_cpu_vector_isa(store: CacheStore, use_stored: bool = True) -> None:
    """Let Inductor probe the CPU now (once a process), its test programs taken from `store` (unless
    `use_stored` is False: the cache's refresh mode) and kept there; where this process probed before
    it used `store` and `store` lacks them, have them built in the background and stored (once a
    process for each cache). Nothing here stops a compile: an entry that cannot be read or stored only
    costs the probe its ~6 s, said in the log."""
    if store.root in _looked:
        return
    _looked.add(store.root)
    fields = probe_fields()
    key = entry_key(fields)
    probed = compat.cpu_vector_isa_detected()
    entry, reason = read_or_refuse(store, key, "probing the CPU afresh") if use_stored else (None, "")
    if probed and entry is not None:
        return
    if reason:
        log.info("Kiln: %s: no stored programs (%s)", LABEL, reason)
    building = any(thread.is_alive() for thread in _building)  # before _programs, which a build fills last
    if probed and _programs:
        _store(store, Entry(key=key, fields=fields, files=dict(_programs)), "the ones this process has")
    elif probed and building:
        _looked.discard(store.root)  # one build at a time: this cache is looked at again at its next lowering
    elif probed and compat.cpu_probe_builds_programs():
        _build_in_background(store, Entry(key=key, fields=fields, files={}))
    elif not probed:
        _probe(store, Entry(key=key, fields=fields, files={}), entry)


def _probe(store: CacheStore, new: Entry, entry: Optional[Entry]) -> None:
    """The process's probe, in Kiln's folder with `entry`'s programs (if any) written there first."""
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
    new.compile_seconds = time.perf_counter() - start
    try:
        new.files = read_files(work)
    except OSError as exc:
        log.info("Kiln: %s: its test programs were not stored (%s)", LABEL, error_text(exc))
        return
    _programs.update(new.files)
    if entry is not None and set(new.files) <= set(entry.files):
        log.info("Kiln: %s loaded its test programs from Kiln's cache (%.1fs)", LABEL, new.compile_seconds)
        return
    _store(store, new, f"built in {new.compile_seconds:.1f}s" +
           ("; the stored ones were for another compiler or torch" if entry is not None else ""))


def _build_in_background(store: CacheStore, new: Entry) -> None:
    """This process probed before it used Kiln's cache: Inductor's probe runs again in a child process,
    into Kiln's folder, and a thread stores the programs when it ends; the compile goes on meanwhile."""
    child = None
    try:
        work = store.work_dir()
        child = compat.start_cpu_probe_child(work)
        atexit.register(_stop, child)  # before the work folder is removed (atexit runs the latest first)
        thread = threading.Thread(target=_store_when_built, args=(store, new, child, work, time.perf_counter()),
                                  name="kiln-cpu-probe", daemon=True)
        thread.start()
    except (CacheError, OSError, RuntimeError, ValueError) as exc:  # RuntimeError: no thread can be started
        if child is not None:
            compat.stop_child(child)
        log.info("Kiln: %s: this process probed before it used Kiln's cache, and its test programs cannot be "
                 "built for it (%s); the next start probes in Kiln's folder", LABEL, said(exc))
        return
    _building.append(thread)
    log.info("Kiln: %s: this process probed before it used Kiln's cache; its test programs are being built in "
             "the background for the next start", LABEL)


def _store_when_built(store: CacheStore, new: Entry, child: subprocess.Popen, work: str, start: float) -> None:
    try:
        try:
            output, errors = child.communicate(timeout=CHILD_SECONDS)
        except subprocess.TimeoutExpired:
            compat.stop_child(child)
            log.info("Kiln: %s: the background build took more than %ss and was stopped; nothing stored", LABEL,
                     CHILD_SECONDS)
            return
        if _exiting:
            return  # stopped as the process exits: nothing to say
        if child.returncode != 0:
            log.info("Kiln: %s: the background build failed (exit %d: %s); nothing stored", LABEL, child.returncode,
                     _last_line(errors, "no message")[:300])
            return
        answer, ours = _last_line(output, ""), compat.cpu_vector_isa_answer()
        if not set(answer.split()) >= set(ours.split()):
            log.info("Kiln: %s: the background build found %r where this process found %r (a load of a test "
                     "program starved past Inductor's 60 s limit on a busy CPU? it said: %s); nothing stored", LABEL,
                     answer[:200], ours, _last_line(errors, "nothing on its error output")[:300])
            return
        new.compile_seconds = time.perf_counter() - start
        new.files = read_files(work)
        if not new.files:
            log.info("Kiln: %s: the background build made no test programs here; nothing to keep", LABEL)
            return
        _programs.update(new.files)
        _store(store, new, f"built in {new.compile_seconds:.1f}s in the background")
    except OSError as exc:
        if not _exiting:
            log.info("Kiln: %s: the background build was not stored (%s)", LABEL, error_text(exc))
    except Exception as exc:  # a background thread says what went wrong, and never more
        if not _exiting:
            log.warning("Kiln: %s: the background build was not stored (%s)", LABEL, said(exc))


def _last_line(text: Optional[str], otherwise: str) -> str:
    """The last line a child wrote to one of its outputs, or `otherwise` if it wrote none."""
    return ((text or "").strip().splitlines()[-1:] or [otherwise])[0]


def _stop(child: subprocess.Popen) -> None:
    """At exit: the build is stopped, and its thread says nothing more."""
    global _exiting
    _exiting = True
    compat.stop_child(child, wait_seconds=2.0)


def _store(store: CacheStore, entry: Entry, how: str) -> None:
    try:
        store.write(entry)
        log.info("Kiln: %s: stored its test programs in Kiln's cache (%s)", LABEL, how)
    except (CacheError, OSError) as exc:
        log.info("Kiln: %s: its test programs were not stored (%s)", LABEL, error_text(exc))
