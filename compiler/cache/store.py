"""Kiln's cache directory: signed entries, written atomically, bounded by least-recently-used eviction.

    <root>/entries/<key>.kiln       one entry per compiled graph and shape variant (entry.py)
    <root>/work/kiln-<pid>-<hex>/   where one process's lowerings read and write Inductor's files,
                                    marked as Kiln's by a .kiln-work file naming the process

The key entries are signed with is not here but in the user's configuration folder (location.py,
trust.py). An entry is written to a temp file and renamed into place, so a reader sees a whole
entry or none, and processes sharing the directory leave it valid. A hit touches the entry's
mtime: eviction drops the oldest first.

Kiln removes only what it made: entries and temp files by their names (`<key>.kiln`,
`.kiln-tmp-<pid>-<hex>`), work folders by name and marker. Nothing else in a directory is touched.
"""
from __future__ import annotations

import atexit
import io
import logging
import os
import re
import secrets
import shutil
import stat
import tarfile
import time
from typing import Iterator, Optional

from ..option_text import shorten
from . import location, trust
from .entry import (KEY_PATTERN, MAGIC, MAX_HEADER_BYTES, SUFFIX, CacheEntryError, Entry, _LENGTH, decode, encode,
                    read_header)

log = logging.getLogger("kiln")

STALE_TEMP_SECONDS = 3600
TEMP_PATTERN = re.compile(r"\.kiln-tmp-\d+-[0-9a-f]{8}")
WORK_PATTERN = re.compile(r"kiln-(\d+)-[0-9a-f]{8}")
WORK_MARKER = ".kiln-work"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class CacheStore:
    """One cache directory (see the module docstring). Every method that reads code checks trust.
    `key_path`: the signing key (default: location.default_key_path(), the user's own)."""

    def __init__(self, root: str, max_bytes: int, key_path: Optional[str] = None):
        trust.say_what_is_unchecked()
        self.root = trust.ensure_private_dir(location.resolve(root))
        self.entries = trust.ensure_private_dir(os.path.join(self.root, "entries"), check_parents=False)
        self.max_bytes = max_bytes
        self.key_path = key_path or location.default_key_path()
        self._key = trust.signing_key(self.key_path)
        self._work: Optional[str] = None

    def path(self, key: str) -> str:
        if not KEY_PATTERN.fullmatch(key):
            raise CacheEntryError(f"{shorten(key)} is not a cache entry key (32 letters and digits)")
        return os.path.join(self.entries, key + SUFFIX)

    # ---- entries ---------------------------------------------------------------------------

    def read(self, key: str) -> Optional[Entry]:
        """The verified entry, or None if there is none. CacheEntryError for a bad one."""
        path = self.path(key)
        try:
            trust.check_private(path, "entry")
            with open(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.max_bytes:
                    raise CacheEntryError(f"cache entry {path} is {size} bytes, more than the cache's whole size cap "
                                          f"({self.max_bytes} bytes): not Kiln's")
                data = f.read()
        except FileNotFoundError:
            return None
        except trust.CacheTrustError as exc:
            raise CacheEntryError(str(exc)) from None
        entry = decode(data, f"cache entry {path}", self._key)
        if entry.key != key:
            raise CacheEntryError(f"cache entry {path} holds the entry {entry.key} (renamed or copied over)")
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        entry.last_used = time.time()
        return entry

    def write(self, entry: Entry) -> int:
        """Sign and store `entry` atomically, then evict down to the size cap. Returns its size.
        OSError (read-only or full disk) propagates: the caller warns and goes on without the cache."""
        entry.created = entry.created or time.time()
        data = encode(entry)
        data += trust.sign(self._key, data)
        temp = os.path.join(self.entries, f".kiln-tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path(entry.key))
        except BaseException:
            _remove(temp)
            raise
        self.evict(keep=entry.key)
        return len(data)

    def remove(self, key: str) -> bool:
        return _remove(self.path(key))

    def headers(self) -> Iterator[tuple[str, Optional[Entry], str]]:
        """(key, entry without files (unverified), problem) for every entry file, newest use first."""
        listing = []
        for name in os.listdir(self.entries):
            key = name[:-len(SUFFIX)]
            if not name.endswith(SUFFIX) or not KEY_PATTERN.fullmatch(key):
                continue
            path = os.path.join(self.entries, name)
            try:
                info = os.lstat(path)
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + _LENGTH.size)
                    if head.startswith(MAGIC) and len(head) == len(MAGIC) + _LENGTH.size:
                        head += f.read(min(_LENGTH.unpack_from(head, len(MAGIC))[0], MAX_HEADER_BYTES))
                header = read_header(head, path, total=info.st_size)
                listing.append((info.st_mtime, key, header.entry(size=info.st_size, last_used=info.st_mtime), ""))
            except FileNotFoundError:
                continue  # evicted meanwhile
            except (OSError, CacheEntryError) as exc:
                listing.append((0.0, key, None, str(exc)))
        for _, key, entry, problem in sorted(listing, key=lambda item: -item[0]):
            yield key, entry, problem

    def evict(self, keep: str = "") -> list[str]:
        """Drop least recently used entries until the directory fits `max_bytes`; drop temp files
        a crashed writer left. Returns the keys dropped."""
        now = time.time()
        for name in os.listdir(self.entries):
            path = os.path.join(self.entries, name)
            if TEMP_PATTERN.fullmatch(name):
                try:
                    info = os.lstat(path)
                    if stat.S_ISREG(info.st_mode) and now - info.st_mtime > STALE_TEMP_SECONDS:
                        _remove(path)
                except FileNotFoundError:
                    pass
        entries = [(key, entry) for key, entry, _ in self.headers() if entry is not None]
        total = sum(entry.size for _, entry in entries)
        dropped = []
        for key, entry in reversed(entries):  # oldest use first
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            if self.remove(key):
                dropped.append(key)
            total -= entry.size
        return dropped

    def clear(self) -> int:
        keys = [key for key, _, _ in self.headers()]
        return sum(self.remove(key) for key in keys)

    # ---- export / import -------------------------------------------------------------------

    def export(self, keys: list[str], out_path: str) -> int:
        """Write the named entries (all if empty) to a tar file, unsigned: the receiving cache signs
        them with its own key on `import_`. Entries are verified here first. Returns how many."""
        keys = keys or [key for key, entry, _ in self.headers() if entry is not None]
        count = 0
        with tarfile.open(out_path, "w") as tar:
            for key in keys:
                entry = self.read(key)
                if entry is None:
                    raise CacheEntryError(f"no cache entry {key} in {self.entries}")
                data = encode(entry)
                info = tarfile.TarInfo(key + SUFFIX)
                info.size, info.mtime = len(data), int(entry.created)
                tar.addfile(info, io.BytesIO(data))
                count += 1
        return count

    def import_(self, path: str) -> list[Entry]:
        """Sign and store every entry of an exported tar file: importing is the user's decision to
        trust that file's code. Each member is checked to be a whole entry under its own key."""
        imported = []
        try:
            with tarfile.open(path, "r") as tar:
                for member in tar.getmembers():
                    if not member.isfile() or not member.name.endswith(SUFFIX):
                        raise CacheEntryError(f"{path}: {member.name!r} is not a Kiln cache entry (made by `kiln cache "
                                              "export`?)")
                    if member.size > self.max_bytes:
                        raise CacheEntryError(f"{path}: {member.name!r} is {member.size} bytes, more than this cache's "
                                              f"size cap ({self.max_bytes} bytes)")
                    data = tar.extractfile(member).read()
                    entry = decode(data, f"{path}:{member.name}", signed_with=None)
                    if os.path.basename(member.name)[:-len(SUFFIX)] != entry.key:
                        raise CacheEntryError(f"{path}: {member.name} holds the entry {entry.key}")
                    imported.append(entry)
        except tarfile.TarError as exc:
            raise CacheEntryError(f"{path} is not a file made by `kiln cache export` ({exc})") from None
        for entry in imported:
            self.write(entry)
        return imported

    # ---- where Inductor works ----------------------------------------------------------------

    def work_dir(self) -> str:
        """A fresh, private directory for one lowering's Inductor files (removed when the process exits)."""
        if self._work is None:
            base = trust.ensure_private_dir(os.path.join(self.root, "work"), check_parents=False)
            _remove_dead_work_dirs(base)
            work = os.path.join(base, f"kiln-{os.getpid()}-{secrets.token_hex(4)}")
            os.mkdir(work, 0o700)
            _write_new(os.path.join(work, WORK_MARKER), str(os.getpid()).encode())
            self._work = work
            atexit.register(shutil.rmtree, work, True)
        path = os.path.join(self._work, secrets.token_hex(6))
        os.mkdir(path, 0o700)
        return path


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _remove_dead_work_dirs(base: str) -> None:
    """Remove the work folders of processes that are gone: only folders named like Kiln's whose
    marker Kiln wrote names that process. Anything else under `base` is left alone."""
    if os.name != "posix":  # os.kill(pid, 0) terminates a process on Windows: leave them
        return
    for name in os.listdir(base):
        match = WORK_PATTERN.fullmatch(name)
        if match is None or _alive(int(match[1])):
            continue
        folder = os.path.join(base, name)
        if stat.S_ISDIR(os.lstat(folder).st_mode) and _marker_pid(folder) == match[1]:
            shutil.rmtree(folder, ignore_errors=True)


def _marker_pid(folder: str) -> str:
    """The process id in a work folder's marker ("" without a readable marker Kiln could have written)."""
    try:
        with open(os.open(os.path.join(folder, WORK_MARKER), os.O_RDONLY | _NOFOLLOW), "rb") as f:
            return f.read(32).decode("ascii", errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _write_new(path: str, data: bytes) -> None:
    """Create `path` (never an existing file, never through a link) with `data`, private."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600), "wb") as f:
        f.write(data)


def read_files(directory: str) -> dict[str, bytes]:
    """Every file under `directory`, by its '/'-separated path relative to it (lock files left out)."""
    files = {}
    for here, _, names in os.walk(directory):
        for name in names:
            if name.endswith(".lock"):
                continue
            path = os.path.join(here, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory).replace(os.sep, "/")] = f.read()
    return files


def write_files(directory: str, files: dict[str, bytes]) -> None:
    """Write an entry's files (validated relative names) into a fresh folder."""
    for name, data in files.items():
        path = os.path.join(directory, *name.split("/"))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        _write_new(path, data)


def read_or_refuse(store: CacheStore, key: str, then: str) -> tuple[Optional[Entry], str]:
    """(entry or None, why none). A damaged, unsigned or foreign entry is refused: said in the log with
    what happens `then` ("compiling it again"), and removed; a read that fails is said in the reason."""
    try:
        return store.read(key), ""
    except CacheEntryError as exc:
        log.warning("Kiln: refused %s; %s", exc, then)
        try:
            store.remove(key)
        except OSError:
            pass  # a read-only directory: the fresh entry's write will say so
        return None, f"refused: {exc}"
    except OSError as exc:
        return None, f"cannot read the entry ({error_text(exc)})"


def error_text(exc: Exception) -> str:
    """What went wrong, in a few words: an OSError's own words ("No space left on device")."""
    return str(getattr(exc, "strerror", None) or exc)


def said(exc: BaseException) -> str:
    """What went wrong, for the log: an OSError's own words, any other error's type and message."""
    return error_text(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
