"""Inductor's precompiled C++ headers, kept in Kiln's cache.

Inductor builds a CPU kernel with a precompiled header of torch's own headers (gcc's `.gch`, about
150 MB, 5-7 s to build on a 2-core CPU), and before it loads a kernel, even one already built, it
makes sure that header exists: a warm start from Kiln's cache builds it again whenever it is
missing. Inductor keeps it in `torchinductor_<user>/precompiled_headers` in the system's temporary
folder (compat.inductor_header_dir), whatever TORCHINDUCTOR_CACHE_DIR says, so after a reboot that
clears it, or in a new container, every warm start paid those seconds. So Kiln keeps the headers
built while it ran as one signed entry per cache and, before a process's first CPU lowering with that
cache (on a warm start beside the first capture: GraphCache.ready_cpu_files_ahead), writes back those
the folder lacks. Inductor's own names decide which header it uses (they hash the header's
preprocessed text, the compiler flags and the compiler's version); a written-back file it
does not name is never read. Once a process, Kiln also asks for the header in a thread beside the
first CPU lowering (lowering.build_cpu_header_ahead), after `restore` where that lowering uses a
cache (restore never writes over a file): gcc builds it there only where it is still missing.

The folder is shared by the user's processes. Kiln notes what it holds when it first looks in a
process, leaving out the headers built since Kiln was loaded (by a compile that did not use Kiln's
cache, an uncached Kiln one or torch.compile's); a header that is not in that note (built by this
process, or by another of the user's processes meanwhile) is stored once gcc has finished it (a
`.gch` being written does not start with gcc's mark yet), together with the written-back headers
Inductor asked for since: Inductor writes a header's small `.h` beside it whenever it asks for it,
and Kiln writes back only the `.gch`, so one left without its `.h` (an older compiler's, after an
update) drops out of the entry. Only gcc's headers are kept: clang's are checked against the time of
the header they were built from.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import time
from typing import Optional

import torch

from .. import compat
from .entry import HEADERS_FIELD, MAX_HEADER_BYTES, size_limit
from .key import entry_key, environment_fields
from .store import CacheStore, Entry, read_or_refuse, said

log = logging.getLogger("kiln")

LABEL = "Inductor's precompiled C++ headers"
NAME = re.compile(r"[A-Za-z0-9_]{1,128}\.h\.gch")  # gcc's, beside Inductor's c<hash>.h
GCC_MARK = b"gpch"  # how a finished .gch starts (gcc writes "gpcWrite" there until it is done)
MAX_SHARE = 0.25  # of the cache's size cap: a larger header would push the compiled graphs out
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_loaded_ns = time.time_ns()  # when this process loaded Kiln: a header built since then is this process's
_found: Optional[set[str]] = None  # the folder's headers, built before Kiln was loaded, when Kiln first looked
_kept: dict[str, set[str]] = {}  # per cache (its root): the headers this process wrote back from it or stored
_refused = ""  # why the folder cannot be used (said once)
_said_clang = False


def header_fields() -> dict:
    """The entry's key fields: the machine, torch (and where it is installed: the compiler's include
    paths are part of a header's name) and Python."""
    environment = environment_fields("cpu")
    return {HEADERS_FIELD: "Inductor's C++ headers",
            **{name: environment[name] for name in ("device", "torch", "python")},
            "torch_dir": os.path.dirname(os.path.abspath(torch.__file__)), "label": LABEL}


def restore(store: CacheStore, use_stored: bool = True) -> None:
    """Once a process for each cache, before its first CPU lowering with it: write into Inductor's
    header folder the headers kept there that the folder lacks (none with `use_stored` False: the
    cache's refresh mode). The first call also notes the headers the folder held before Kiln was
    loaded. Nothing here stops a compile: whatever fails costs the header's build, said in the log."""
    global _found
    if store.root in _kept:
        return
    _kept[store.root] = set()
    folder, written = None, []  # written: the names Kiln wrote back, even where it then failed
    try:
        folder = compat.inductor_header_dir()
        if folder is not None and use_stored:
            _restore_from(store, folder, written)
    except Exception as exc:  # the cache never stops a compile
        log.warning("Kiln: %s were not written back (%s); Inductor builds what it lacks", LABEL, said(exc))
    if _found is None:
        _found = set(_headers_in(_listing(folder), folder, built_before=_loaded_ns)) if folder else set()
    _found.update(written)  # Kiln's own writing, not a header that appeared


def _restore_from(store: CacheStore, folder: str, written: list[str]) -> None:
    """Write the kept headers `folder` lacks back into it, their names added to `written` as each is."""
    start = time.perf_counter()
    entry, reason = read_or_refuse(store, entry_key(header_fields()), "Inductor builds its headers")
    if reason:
        log.info("Kiln: %s: none kept (%s)", LABEL, reason)
    if entry is None:
        return
    try:
        _write_back(folder, entry.files, written)
    except FolderRefused as exc:
        _refuse(str(exc))
        return
    except ValueError as exc:  # a newer header stored by this process replaces the entry
        log.warning("Kiln: %s were not written back (%s); Inductor builds what it lacks", LABEL, exc)
        return
    _kept[store.root].update(entry.files)
    if written:
        log.info("Kiln: %s: wrote %s back from Kiln's cache into %s (%.1f MiB, %.1fs)", LABEL, ", ".join(written),
                 folder, sum(len(entry.files[n]) for n in written) / 2**20, time.perf_counter() - start)


def keep_new(store: CacheStore) -> None:
    """After a CPU lowering: when Inductor's folder holds a finished header that Kiln did not note when
    it first looked (one built since Kiln was loaded), store it as the cache's entry, with the
    written-back ones Inductor asked for."""
    try:
        folder = compat.inductor_header_dir()
        if folder is None or _found is None or _refused or store.root not in _kept or not os.path.isdir(folder):
            return
        _keep_new(store, folder)
    except Exception as exc:  # the cache never stops a compile, and never loses a finished lowering
        log.info("Kiln: %s were not stored (%s)", LABEL, said(exc))


def _keep_new(store: CacheStore, folder: str) -> None:
    global _said_clang
    try:
        _check_folder(folder)  # what others could put there is not signed as the user's
    except FolderRefused as exc:
        _refuse(str(exc))
        return
    names = _listing(folder)
    present = set(_headers_in(names, folder))
    kept = _kept[store.root]
    new = sorted(name for name in present - _found - kept if _finished(os.path.join(folder, name)))
    if not _said_clang and any(name.endswith(".pch") for name in names):
        _said_clang = True
        log.info("Kiln: %s: clang's are not kept (clang checks them against the time of the header they were "
                 "built from); a warm start after the temporary folder was cleared builds them again", LABEL)
    if not new:
        return
    _found.update(new)  # looked at once: a header that cannot be stored is not read again at every lowering
    asked = [name for name in sorted(kept & present) if os.path.exists(os.path.join(folder, name[:-len(".gch")]))]
    share = int(store.max_bytes * MAX_SHARE)
    entry_room = size_limit(header_fields())[0] - MAX_HEADER_BYTES  # an entry's limit, less room for its header
    total = sum(os.lstat(os.path.join(folder, name)).st_size for name in new + asked)
    if total > min(share, entry_room):
        why = (f"more than {MAX_SHARE:.0%} of the cache's size cap (max_gb), they would push compiled graphs out"
               if share <= entry_room else f"more than an entry of them may hold ({entry_room / 2**20:.0f} MiB)")
        log.info("Kiln: %s (%.1f MiB) are not stored: %s", LABEL, total / 2**20, why)
        return
    share = min(share, entry_room)
    start = time.perf_counter()
    files = {}
    for name in new + asked:
        files[name] = _read(os.path.join(folder, name), share - sum(map(len, files.values())))
    size = store.write(Entry(key=entry_key(header_fields()), fields=header_fields(), files=files))
    _kept[store.root] = set(files)
    log.info("Kiln: %s: stored %s in Kiln's cache (%.1f MiB, %.1fs): a later start writes them back if they "
             "are gone", LABEL, ", ".join(sorted(files)), size / 2**20, time.perf_counter() - start)


def _refuse(why: str) -> None:
    """The folder cannot be used: said once; nothing is written into it or stored from it from now on."""
    global _refused
    if not _refused:
        _refused = why
        log.warning("Kiln: %s are not kept (%s); Inductor builds them where they are missing", LABEL, why)


def _write_back(folder: str, files: dict[str, bytes], written: list[str]) -> None:
    """Write each of `files` that `folder` lacks (the folder made, private, if missing; never into one
    that is a link or that others could change), each whole or not at all, never over a file; each name
    is added to `written` once its file is there."""
    bad = [name for name in files if not NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"the entry's file {bad[0][:80]!r} is not a precompiled header's name")
    for path in (os.path.dirname(folder), folder):  # each made private: makedirs' mode is the last folder's only
        if not os.path.lexists(path):
            os.mkdir(path, 0o700)
    _check_folder(folder)
    for name, data in sorted(files.items()):
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            continue
        temp = os.path.join(folder, f".kiln-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600), "wb") as f:
                f.write(data)
            os.link(temp, path)  # fails where a file appeared meanwhile: it is left as it is
            written.append(name)
        except FileExistsError:
            pass
        finally:
            try:
                os.remove(temp)
            except OSError:
                pass


class FolderRefused(ValueError):
    """Inductor's header folder is not one Kiln writes into or stores from; the message says why."""


def _check_folder(folder: str) -> None:
    """FolderRefused, saying why, unless `folder` and the folder above it (`torchinductor_<user>`) are real
    folders of this user that no one else can write (POSIX; elsewhere Kiln does not check)."""
    if os.name != "posix":
        return
    for path in (folder, os.path.dirname(folder)):
        info = os.lstat(path)
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise FolderRefused(f"Inductor's folder {path} is a symbolic link or not a folder")
        if info.st_uid != os.getuid():
            raise FolderRefused(f"Inductor's folder {path} belongs to uid {info.st_uid}, not to you")
        if mode & 0o022:
            raise FolderRefused(f"Inductor's folder {path} can be written by other users (mode {mode:04o}; "
                                f"chmod go-w {path} lets Kiln keep its headers)")


def _listing(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _headers_in(names: list[str], folder: str, built_before: Optional[int] = None) -> list[str]:
    """Of `names` (listed in `folder`), the regular files named as precompiled headers (last written
    before `built_before`, in nanoseconds since the epoch, where given)."""
    found = []
    for name in names:
        if not NAME.fullmatch(name):
            continue
        try:
            info = os.lstat(os.path.join(folder, name))
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and (built_before is None or info.st_mtime_ns < built_before):
            found.append(name)
    return found


def _finished(path: str) -> bool:
    """gcc has finished writing it: it starts with gcc's mark (a file being written starts "gpcWrite")."""
    try:
        with open(os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK), "rb") as f:
            return f.read(len(GCC_MARK)) == GCC_MARK
    except OSError:
        return False


def _read(path: str, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (never through a link, never waiting on a pipe)."""
    with open(os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK), "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise ValueError(f"{path} is not a regular file of at most {limit} bytes")
        return f.read(info.st_size)
