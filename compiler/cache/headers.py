"""Inductor's precompiled C++ headers, kept in Kiln's cache.

Inductor builds a CPU kernel with a precompiled header of torch's own headers (a `.gch` of about
150 MB, 5-7 s to build on a 2-core CPU), and before it loads a kernel, even one already built, it
makes sure that header exists: a warm start from Kiln's cache builds it again whenever it is
missing. Inductor keeps it in `torchinductor_<user>/precompiled_headers` in the system's temporary
folder (compat.inductor_header_dir), whatever TORCHINDUCTOR_CACHE_DIR says, so after a reboot that
clears it, or in a new container, every warm start paid those seconds. So Kiln keeps the headers a
process built as one signed entry and, before a process's first CPU lowering, writes back those the
folder lacks. Inductor's own names decide which header it uses (they hash the header's preprocessed
text, the compiler flags and the compiler's version), so after an update it builds a new one, which
then replaces the entry; a written-back file it does not name is never read.

What the folder held when Kiln first looked in this process is remembered for the process (the
folder is the process's, like Inductor's answer to its CPU probe): the headers that appear after that
were built by this process and are stored. A file still being written (changed in the last
SETTLE_SECONDS) is left for the next look.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import time
from typing import Optional

from .. import compat
from . import trust
from .key import entry_key, environment_fields
from .store import CacheStore, Entry, error_text, read_or_refuse
from .trust import CacheError

log = logging.getLogger("kiln")

LABEL = "Inductor's precompiled C++ headers"
NAME = re.compile(r"[A-Za-z0-9_]{1,128}\.h(\.gch)?")  # Inductor's: c<hash>.h and c<hash>.h.gch
SETTLE_SECONDS = 2.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_found: Optional[set[str]] = None  # the folder's headers when Kiln first looked in this process


def header_fields() -> dict:
    """The entry's key fields: the machine, torch and Python (Inductor's names tell the compiler and
    flags apart within them)."""
    environment = environment_fields("cpu")
    return {"precompiled_headers": "Inductor's C++ headers",
            **{name: environment[name] for name in ("device", "torch", "python")}, "label": LABEL}


def restore(store: CacheStore, use_stored: bool = True) -> None:
    """Once a process, before its first CPU lowering: write into Inductor's header folder the kept
    headers it lacks (none with `use_stored` False: the cache's refresh mode), then note what it holds.
    Nothing here stops a compile: whatever fails costs the header's build, said in the log."""
    global _found
    if _found is not None:
        return
    folder = compat.inductor_header_dir()
    if folder is None:
        _found = set()
        return
    start = time.perf_counter()
    entry, reason = (read_or_refuse(store, entry_key(header_fields()), "Inductor builds its headers")
                     if use_stored else (None, ""))
    if reason:
        log.info("Kiln: %s: none kept (%s)", LABEL, reason)
    if entry is not None:
        try:
            written = _write_back(folder, entry.files)
        except (CacheError, OSError, ValueError) as exc:
            log.warning("Kiln: %s were not written back into %s (%s); Inductor builds what it lacks",
                        LABEL, folder, error_text(exc))
        else:
            if written:
                log.info("Kiln: %s: wrote %s back from Kiln's cache into %s (%.1f MiB, %.1fs)", LABEL,
                         ", ".join(written), folder, sum(len(entry.files[n]) for n in written) / 2**20,
                         time.perf_counter() - start)
    _found = set(_headers_in(folder))


def keep_new(store: CacheStore) -> None:
    """After a CPU lowering: store the headers that appeared in Inductor's folder since `restore`
    looked (this process built them), as the entry (replacing one kept for an older compiler)."""
    global _found
    folder = compat.inductor_header_dir()
    if folder is None or _found is None or not os.path.isdir(folder):
        return
    settled = time.time() - SETTLE_SECONDS
    try:
        trust.check_parent_dirs(folder)  # what others could have put there is not signed as ours
        trust.check_private(folder, "directory")
        new = [name for name, changed in _headers_in(folder).items() if name not in _found and changed < settled]
        if not new:
            return
        start = time.perf_counter()
        files = {name: _read(os.path.join(folder, name)) for name in new}
        size = store.write(Entry(key=entry_key(header_fields()), fields=header_fields(), files=files))
        seconds = time.perf_counter() - start
    except (CacheError, OSError) as exc:
        log.info("Kiln: %s in %s were not stored (%s)", LABEL, folder, error_text(exc))
        return
    _found |= set(new)
    log.info("Kiln: %s: stored %s in Kiln's cache (%.1f MiB, %.1fs): a later start writes them back if they "
             "are gone", LABEL, ", ".join(sorted(new)), size / 2**20, seconds)


def _write_back(folder: str, files: dict[str, bytes]) -> list[str]:
    """Write each of `files` that `folder` lacks (the folder made private if missing; never one that is
    a link or that others could change); each appears whole or not at all. The names written."""
    bad = [name for name in files if not NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"the entry's file {bad[0][:80]!r} is not a header's name")
    trust.ensure_private_dir(folder)
    written = []
    for name, data in sorted(files.items()):
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            continue
        temp = os.path.join(folder, f".kiln-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600), "wb") as f:
                f.write(data)
            os.replace(temp, path)
        except BaseException:
            try:
                os.remove(temp)
            except OSError:
                pass
            raise
        written.append(name)
    return written


def _headers_in(folder: str) -> dict[str, float]:
    """The regular files in `folder` named as headers, with when each last changed."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    found = {}
    for name in names:
        if not NAME.fullmatch(name):
            continue
        try:
            info = os.lstat(os.path.join(folder, name))
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found[name] = info.st_mtime
    return found


def _read(path: str) -> bytes:
    with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
        return f.read()
