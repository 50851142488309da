"""Kiln's cache directory: signed entries, written atomically, bounded by least-recently-used eviction.

    <root>/signing.key          the per-user HMAC key (0600), see trust.py
    <root>/entries/<key>.kiln   one entry per compiled graph and shape variant
    <root>/work/<process>/      where this process's lowerings read and write Inductor's files

An entry file is MAGIC, an 8-byte header length, a JSON header (key fields, file list, compile
seconds), the files' bytes, and an HMAC-SHA256 of everything before it. It is written to a temp
file and renamed into place, so a reader sees a whole entry or none, and processes sharing the
directory leave it valid. A hit touches the entry's mtime: eviction drops the oldest first.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import secrets
import shutil
import struct
import tarfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from . import trust

MAGIC = b"KILN-CACHE-ENTRY 1\n"
SUFFIX = ".kiln"
_LENGTH = struct.Struct(">Q")
STALE_TEMP_SECONDS = 3600


class CacheEntryError(RuntimeError):
    """An entry is damaged, unsigned or foreign: it is refused (and compiled again)."""


@dataclass
class Entry:
    key: str
    fields: dict
    files: dict[str, bytes] = field(default_factory=dict)   # path under Inductor's cache dir -> bytes
    compile_seconds: float = 0.0                           # what the cold compile cost
    created: float = 0.0
    size: int = 0                                          # bytes on disk
    last_used: float = 0.0


def encode(entry: Entry) -> bytes:
    """The entry's unsigned bytes (MAGIC, header, files)."""
    names = sorted(entry.files)
    header = json.dumps({"key": entry.key, "fields": entry.fields, "files": [[n, len(entry.files[n])] for n in names],
                         "compile_seconds": entry.compile_seconds, "created": entry.created}, sort_keys=True).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header] + [entry.files[n] for n in names])


def read_header(data: bytes, where: str) -> tuple[dict, int]:
    """(header, offset of the files); CacheEntryError if `data` does not start like an entry."""
    if not data.startswith(MAGIC):
        raise CacheEntryError(f"{where} is not a Kiln cache entry (or not of this format version)")
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start:
        raise CacheEntryError(f"{where} is truncated ({len(data)} bytes)")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start:start + length])
        files = [(str(name), int(size)) for name, size in header["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheEntryError(f"{where} has a damaged header ({type(exc).__name__}) or is truncated") from None
    header["files"] = files
    return header, start + length


def decode(data: bytes, where: str, signed_with: Optional[bytes]) -> Entry:
    """An Entry from signed bytes (`signed_with`: the key to check) or unsigned ones (None)."""
    header, offset = read_header(data, where)
    body = offset + sum(size for _, size in header["files"])
    expected = body + (trust.SIGNATURE_BYTES if signed_with is not None else 0)
    if signed_with is not None and len(data) == body:
        raise CacheEntryError(f"{where} is unsigned: Kiln loads only entries it signed itself; bring entries from "
                              "elsewhere in with `kiln cache import`")
    if len(data) < expected:
        raise CacheEntryError(f"{where} is truncated ({len(data)} of {expected} bytes)")
    if len(data) > expected:
        raise CacheEntryError(f"{where} has {len(data) - expected} unexpected trailing bytes")
    if signed_with is not None and not trust.verify(signed_with, data[:body], data[body:]):
        raise CacheEntryError(f"{where} fails its signature: it was changed after Kiln wrote it, or was written with "
                              "another user's or machine's key (copied in?); bring entries from elsewhere in with "
                              "`kiln cache import`")
    files, position = {}, offset
    for name, size in header["files"]:
        if os.path.isabs(name) or ".." in name.split("/"):
            raise CacheEntryError(f"{where} names a file outside its directory: {name!r}")
        files[name] = data[position:position + size]
        position += size
    return Entry(key=header["key"], fields=header["fields"], files=files, compile_seconds=header.get("compile_seconds", 0.0),
                 created=header.get("created", 0.0), size=len(data))


class CacheStore:
    """One cache directory (see the module docstring). Every method that reads code checks trust."""

    def __init__(self, root: str, max_bytes: int):
        self.root = trust.ensure_private_dir(root)
        self.entries = trust.ensure_private_dir(os.path.join(self.root, "entries"))
        self.max_bytes = max_bytes
        self._key = trust.signing_key(self.root)
        self._work: Optional[str] = None

    def path(self, key: str) -> str:
        return os.path.join(self.entries, key + SUFFIX)

    # ---- entries ---------------------------------------------------------------------------

    def read(self, key: str) -> Optional[Entry]:
        """The verified entry, or None if there is none. CacheEntryError for a bad one."""
        path = self.path(key)
        try:
            trust.check_private(path, "entry")
            with open(path, "rb") as f:
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
        temp = os.path.join(self.entries, f".tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(self.entries, name)
            try:
                info = os.stat(path)
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + _LENGTH.size)
                    if head.startswith(MAGIC) and len(head) == len(MAGIC) + _LENGTH.size:
                        head += f.read(_LENGTH.unpack_from(head, len(MAGIC))[0])
                header, _ = read_header(head, path)
                entry = Entry(key=header["key"], fields=header["fields"], compile_seconds=header.get("compile_seconds", 0.0),
                              created=header.get("created", 0.0), size=info.st_size, last_used=info.st_mtime)
                listing.append((info.st_mtime, name[:-len(SUFFIX)], entry, ""))
            except FileNotFoundError:
                continue  # evicted meanwhile
            except (OSError, CacheEntryError) as exc:
                listing.append((0.0, name[:-len(SUFFIX)], None, str(exc)))
        for _, key, entry, problem in sorted(listing, key=lambda item: -item[0]):
            yield key, entry, problem

    def evict(self, keep: str = "") -> list[str]:
        """Drop least recently used entries until the directory fits `max_bytes`; drop temp files
        a crashed writer left. Returns the keys dropped."""
        now = time.time()
        for name in os.listdir(self.entries):
            path = os.path.join(self.entries, name)
            if name.startswith(".tmp-"):
                try:
                    if now - os.stat(path).st_mtime > STALE_TEMP_SECONDS:
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
        with tarfile.open(path, "r") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.endswith(SUFFIX):
                    raise CacheEntryError(f"{path}: {member.name!r} is not a Kiln cache entry (made by `kiln cache export`?)")
                data = tar.extractfile(member).read()
                entry = decode(data, f"{path}:{member.name}", signed_with=None)
                if os.path.basename(member.name)[:-len(SUFFIX)] != entry.key:
                    raise CacheEntryError(f"{path}: {member.name} holds the entry {entry.key}")
                imported.append(entry)
        for entry in imported:
            self.write(entry)
        return imported

    # ---- where Inductor works ----------------------------------------------------------------

    def work_dir(self) -> str:
        """A fresh, private directory for one lowering's Inductor files (removed when the process exits)."""
        if self._work is None:
            base = trust.ensure_private_dir(os.path.join(self.root, "work"))
            _remove_dead_work_dirs(base)
            self._work = os.path.join(base, f"{os.getpid()}-{secrets.token_hex(4)}")
            os.mkdir(self._work, 0o700)
            atexit.register(shutil.rmtree, self._work, True)
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
    if os.name != "posix":  # os.kill(pid, 0) terminates a process on Windows: leave them
        return
    for name in os.listdir(base):
        pid = name.split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


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
    for name, data in files.items():
        path = os.path.join(directory, *name.split("/"))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
