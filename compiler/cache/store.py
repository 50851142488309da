"""Kiln's cache directory: signed entries, written atomically, bounded by least-recently-used eviction.

    <root>/entries/<key>.kiln       one entry per compiled graph and shape variant (entry.py)
    <root>/work/kiln-<pid>-<hex>/   where one process's lowerings read and write Inductor's files,
                                    marked as Kiln's by a .kiln-work file naming the process, which
                                    holds a lock on it while it lives

The key entries are signed with is not here but in the user's configuration folder (location.py,
trust.py). An entry is written to a temp file and renamed into place, so a reader sees a whole
entry or none, and processes sharing the directory leave it valid. A hit touches the entry's
mtime: eviction drops the oldest first.

Kiln removes only what it made: entries and temp files by their names (`<key>.kiln`,
`.kiln-tmp-<pid>-<hex>`), work folders by name and marker. Nothing else in a directory is touched.
What is in the directory is untrusted: every file is opened without following a link or waiting on a
pipe, and only a regular file is read; an entry's header is read before the rest (a bounded read),
and its size is held to its kind's limit (entry.py) as well as to the cache's cap.
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
from typing import BinaryIO, Iterator, Optional

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from ..options.option_text import shorten
from . import location, trust
from .entry import (KEY_PATTERN, MAX_ENTRY_BYTES, SUFFIX, CacheEntryError, Entry, check_size,
                    encode, read_entry, read_head, read_header)
from .trust import CacheError

log = logging.getLogger("kiln")

STALE_TEMP_SECONDS = 3600
TEMP_PATTERN = re.compile(r"\.kiln-tmp-\d+-[0-9a-f]{8}")
WORK_PATTERN = re.compile(r"kiln-(\d+)-[0-9a-f]{8}")
WORK_MARKER = ".kiln-work"
MAX_IMPORT_ENTRIES = 100_000  # members of a file `kiln cache import` reads (tarfile keeps a record of each)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_work_folders: dict[str, str] = {}  # this process's work folder in each cache's work directory
_held_markers: dict[str, BinaryIO] = {}  # their markers, open (and locked) while the process lives


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

    def path(self, key: str) -> str:
        if not KEY_PATTERN.fullmatch(key):
            raise CacheEntryError(f"{shorten(key)} is not a cache entry key (32 letters and digits)")
        return os.path.join(self.entries, key + SUFFIX)

    # ---- entries ---------------------------------------------------------------------------

    def read(self, key: str) -> Optional[Entry]:
        """The verified entry, or None if there is none. CacheEntryError for a bad one."""
        path = self.path(key)
        try:
            with trust.open_private(path, "entry") as f:
                entry = read_entry(f, os.fstat(f.fileno()).st_size, f"cache entry {path}", self._key, cap=self.max_bytes)
        except FileNotFoundError:
            return None
        except trust.CacheTrustError as exc:
            raise CacheEntryError(str(exc)) from None
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
        CacheEntryError for an entry a read would refuse (a bad name, too large): nothing is stored.
        OSError (read-only or full disk) propagates: the caller warns and goes on without the cache."""
        entry.created = entry.created or time.time()
        data = encode(entry)
        where = f"the entry {entry.key} ({shorten(entry.fields.get('label', ''))})"
        read_header(data, where)
        check_size(len(data) + trust.SIGNATURE_BYTES, where, self.max_bytes)
        temp = os.path.join(self.entries, f".kiln-tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _BINARY, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.write(trust.sign(self._key, data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path(entry.key))
        except BaseException:
            _remove(temp)
            raise
        self.evict(keep=entry.key)
        return len(data) + trust.SIGNATURE_BYTES

    def remove(self, key: str) -> bool:
        return _remove(self.path(key))

    def _listing(self) -> list[tuple[str, str, os.stat_result]]:
        """(key, path, lstat) of every file named like an entry, newest use first; nothing is read."""
        found = []
        for name in os.listdir(self.entries):
            key = name[:-len(SUFFIX)]
            if not name.endswith(SUFFIX) or not KEY_PATTERN.fullmatch(key):
                continue
            path = os.path.join(self.entries, name)
            try:
                found.append((key, path, os.lstat(path)))
            except FileNotFoundError:
                continue  # evicted meanwhile
        return sorted(found, key=lambda item: -item[2].st_mtime)

    def keys(self) -> list[str]:
        """The key of every file named like an entry, newest use first (none is read)."""
        return [key for key, _, _ in self._listing()]

    def headers(self) -> Iterator[tuple[str, Optional[Entry], str]]:
        """(key, entry without files (unverified), problem) for every entry file, newest use first.
        Each header is read as it is yielded (a bounded read: entry.MAX_HEADER_BYTES) and kept by no one here."""
        for key, path, _ in self._listing():
            try:
                with trust.open_private(path, "entry") as f:
                    info = os.fstat(f.fileno())
                    header = read_header(read_head(f), path, total=info.st_size)
            except FileNotFoundError:
                continue  # evicted meanwhile
            except (OSError, CacheError) as exc:
                yield key, None, str(exc)
                continue
            yield key, header.entry(size=info.st_size, last_used=info.st_mtime), ""

    def evict(self, keep: str = "") -> list[str]:
        """Drop least recently used entries until the directory fits `max_bytes`; drop temp files
        a crashed writer left. Every regular file named like an entry counts, by its size, a damaged
        one too; none is read. Returns the keys dropped."""
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
        sizes = [(key, info.st_size) for key, _, info in self._listing() if stat.S_ISREG(info.st_mode)]
        total = sum(size for _, size in sizes)
        dropped = []
        for key, size in reversed(sizes):  # oldest use first
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            if self.remove(key):
                dropped.append(key)
            total -= size
        return dropped

    def clear(self) -> int:
        return sum(self.remove(key) for key in self.keys())

    # ---- export / import -------------------------------------------------------------------

    def export(self, keys: list[str], out_path: str) -> int:
        """Write the named entries (all if empty) to an uncompressed tar file of plain files (ustar,
        what `import_` reads), unsigned: the receiving cache signs them with its own key on `import_`.
        Entries are verified here first, and held in memory one at a time. Returns how many."""
        keys = keys or [key for key, entry, _ in self.headers() if entry is not None]
        count = 0
        with tarfile.open(out_path, "w:", format=tarfile.USTAR_FORMAT) as tar:
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
        """Sign and store every entry of a file `export` wrote (an uncompressed tar of plain files):
        importing is the user's decision to trust that file's code. The entries must fit the size cap
        together; each is checked to be a whole entry under its own key within its kind's limit (its
        MAGIC and header first), and stored in turn, one in memory at a time. Returns the entries
        (without their files) that are in the cache at the end."""
        imported: dict[str, Entry] = {}
        try:
            with _open_regular(path) as raw, tarfile.open(fileobj=raw, mode="r:", tarinfo=_PlainMember) as tar:
                for member in self._members(tar, raw, path):
                    where = f"{path}:{member.name}"
                    entry = read_entry(tar.extractfile(member), member.size, where, signed_with=None, cap=self.max_bytes)
                    if os.path.basename(member.name)[:-len(SUFFIX)] != entry.key:
                        raise CacheEntryError(f"{path}: {member.name} holds the entry {entry.key}")
                    self.write(entry)
                    imported[entry.key] = Entry(key=entry.key, fields=entry.fields, compile_seconds=entry.compile_seconds,
                                                created=entry.created)
        except (tarfile.TarError, CacheEntryError) as exc:
            text = (str(exc) if isinstance(exc, CacheEntryError) else
                    f"{path} is not a whole file made by `kiln cache export` ({exc}): Kiln imports the uncompressed tar "
                    "files of plain entries it exports")
            if imported:
                text += f"; the {len(imported)} entries before it were imported"
            raise CacheEntryError(text) from None
        return [entry for key, entry in imported.items() if os.path.exists(self.path(key))]

    def _members(self, tar: tarfile.TarFile, raw: BinaryIO, path: str) -> list[tarfile.TarInfo]:
        """The members of an exported file (`tar`, read from `raw`), each one named and sized like an
        entry, all of them fitting this cache's size cap together, the file whole up to its end
        marker (nothing read but the tar file's own records)."""
        largest = min(MAX_ENTRY_BYTES, self.max_bytes)
        members = []
        for member in tar:
            if len(members) == MAX_IMPORT_ENTRIES:
                raise CacheEntryError(f"{path} holds more than {MAX_IMPORT_ENTRIES} members: not a file made by "
                                      "`kiln cache export`")
            if not member.isfile() or not member.name.endswith(SUFFIX):
                raise CacheEntryError(f"{path}: {member.name!r} is not a Kiln cache entry (made by `kiln cache "
                                      "export`?)")
            if member.size > largest:
                raise CacheEntryError(f"{path}: {member.name!r} is {member.size} bytes, more than the largest entry "
                                      f"this cache takes ({largest} bytes)")
            members.append(member)
        raw.seek(tar.offset)  # where tarfile stopped: the end marker, two blocks of zeros (tarfile takes a cut for one)
        end = raw.read(2 * tarfile.BLOCKSIZE)
        if len(end) < 2 * tarfile.BLOCKSIZE or end.strip(b"\0"):
            raise tarfile.ReadError(f"unexpected end of data after {len(members)} entries")
        total = sum(member.size + trust.SIGNATURE_BYTES for member in members)
        if total > self.max_bytes:
            raise CacheEntryError(f"{path} holds {len(members)} entries of {total} bytes in all (signed), more than this "
                                  f"cache's size cap ({self.max_bytes} bytes): nothing imported; export fewer entries "
                                  "(`kiln cache export FILE KEY...`) or use a cache with a larger max_gb")
        return members

    # ---- where Inductor works ----------------------------------------------------------------

    def work_dir(self) -> str:
        """A fresh, private directory for one lowering's Inductor files, in this process's work folder
        of this cache (made at the first call in a process, with one marker held open; removed when the
        process exits)."""
        base = os.path.join(self.root, "work")
        work = _work_folders.get(base)
        if work is None:
            trust.ensure_private_dir(base, check_parents=False)
            _remove_dead_work_dirs(base)
            work = os.path.join(base, f"kiln-{os.getpid()}-{secrets.token_hex(4)}")
            os.mkdir(work, 0o700)
            _hold_marker(os.path.join(work, WORK_MARKER))
            _work_folders[base] = work
            atexit.register(shutil.rmtree, work, True)
        path = os.path.join(work, secrets.token_hex(6))
        os.mkdir(path, 0o700)
        return path


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _hold_marker(path: str) -> None:
    """Write a work folder's marker: this process's id, under a lock (flock) that the process holds
    while it lives (the marker stays open). The lock, not the id, tells another process whether the
    folder is in use: process ids differ between containers sharing a cache directory. The id is
    written once the lock is held: a marker without it is never removed by another process (where
    there is no flock, as on Windows, none is written)."""
    marker = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _BINARY, 0o600), "wb")
    _held_markers[path] = marker
    if fcntl is None:
        return
    try:
        fcntl.flock(marker, fcntl.LOCK_EX)
    except OSError as exc:  # a file system without locks: the folder is left to this process's exit
        log.info("Kiln: the work folder %s cannot be locked (%s): only this process removes it", path, error_text(exc))
        return
    marker.write(str(os.getpid()).encode())
    marker.flush()


def _remove_dead_work_dirs(base: str) -> None:
    """Remove the work folders of processes that have ended: only folders named like Kiln's whose
    marker names that process and is locked by no process (its process, in this container or
    another, holds the lock while it lives). Two processes may clean at once: a folder gone
    meanwhile is done. Anything else under `base` is left alone; without flock (Windows), all is."""
    if fcntl is None:
        return
    for name in os.listdir(base):
        match = WORK_PATTERN.fullmatch(name)
        folder = os.path.join(base, name)
        if match is None or os.path.join(folder, WORK_MARKER) in _held_markers:
            continue
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                continue
            with open(os.open(os.path.join(folder, WORK_MARKER), os.O_RDONLY | _NOFOLLOW | _NONBLOCK), "rb") as marker:
                if not stat.S_ISREG(os.fstat(marker.fileno()).st_mode):
                    continue
                fcntl.flock(marker, fcntl.LOCK_SH | fcntl.LOCK_NB)  # BlockingIOError: its process lives
                if marker.read(32) == match[1].encode():
                    shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # removed meanwhile, in use, or no marker of Kiln's
            continue


class _PlainMember(tarfile.TarInfo):
    """A member of a file `import_` reads: a plain file, as `export` writes them. Any other record is
    refused before tarfile reads it (a pax or GNU long-name record is read whole into memory, whatever
    size it claims)."""

    @classmethod
    def frombuf(cls, buf, encoding, errors):
        member = super().frombuf(buf, encoding, errors)
        if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise tarfile.ReadError(f"{member.name!r} is a record of type {member.type!r}, not a Kiln cache entry")
        return member


def _open_regular(path: str) -> BinaryIO:
    """`path` opened for reading, never waiting on a pipe; CacheEntryError unless it is a regular file."""
    f = open(os.open(path, os.O_RDONLY | _NONBLOCK | _BINARY), "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise CacheEntryError(f"{path} is not a regular file (made by `kiln cache export`?)")
    return f


def _write_new(path: str, data: bytes) -> None:
    """Create `path` (never an existing file, never through a link) with `data`, private."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _BINARY, 0o600), "wb") as f:
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
