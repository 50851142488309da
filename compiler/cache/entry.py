"""One cache entry's bytes: what an entry holds, how it is encoded, and its header read as untrusted data.

An entry file is MAGIC, an 8-byte header length, a JSON header (key fields, file list, compile
seconds), the files' bytes, and an HMAC-SHA256 of everything before it (trust.py). The header is
untrusted until the signature is checked, so it is validated against its schema (`read_header`:
a safe key, shallow key fields, safe relative file names that can all be written into one folder,
sizes that fit the entry, times in range) before anything reads it; listing, lookups, import and
miss explanations all go through it. An entry is read from its start (`read_entry`): its MAGIC and
header first, from a bounded read, then its size against its kind's limit, and only then its files.
"""
from __future__ import annotations

import hmac
import io
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Optional

from ..options.option_text import shorten
from . import trust
from .trust import CacheError

MAGIC = b"KILN-CACHE-ENTRY 2\n"  # 2: no CPU probe or C++ header entries (format 1 kept them)
SUFFIX = ".kiln"
_LENGTH = struct.Struct(">Q")
KEY_PATTERN = re.compile(r"[0-9a-z]{32}")               # entry_key's 32 hex digits (tests use letters too)
_START = len(MAGIC) + _LENGTH.size                      # where the header begins
# a header is the key fields (a few KiB) and the file list (about 100 bytes a file; Inductor writes
# about 8 files per Triton kernel): 4 MiB holds 40,000 files. Listing reads each entry's header.
MAX_HEADER_BYTES = 4 * 2**20
MAX_FILES = 100_000
MAX_FIELD_DEPTH = 8                                      # key fields nest options.passes.<name>: depth 3
MAX_NAME_PART_BYTES = 255                                # NAME_MAX: one folder or file name, encoded
MAX_NAME_BYTES = 1024                                    # a whole relative name (Inductor's: under 200 bytes)
MAX_SECONDS = 8**11 - 1                                  # created, compile_seconds: the largest time a tar
                                                         # header holds (year 2242), `kiln cache export`'s
# an entry's whole size (besides the cache's size cap): an entry of compiled graphs (a whole SD1.5 UNet
# on a CPU is a few MiB; a GPU model's kernels take more) or a record
MAX_ENTRY_BYTES = 512 * 2**20


class CacheEntryError(CacheError):
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


@dataclass(frozen=True)
class Header:
    """An entry's header, validated: a safe key, key fields that are a shallow JSON mapping, files
    with safe relative names that fit one folder and sizes that fit the entry, times in range."""

    key: str
    fields: dict
    files: tuple[tuple[str, int], ...]
    compile_seconds: float
    created: float
    body_offset: int                                       # where the files' bytes begin

    @property
    def body_end(self) -> int:
        return self.body_offset + sum(size for _, size in self.files)

    def entry(self, **values) -> Entry:
        return Entry(key=self.key, fields=self.fields, compile_seconds=self.compile_seconds, created=self.created, **values)


def check_size(size: int, where: str, cap: Optional[int] = None) -> None:
    """CacheEntryError unless an entry of `size` bytes fits MAX_ENTRY_BYTES and `cap` (the cache's size cap)."""
    limit, what = MAX_ENTRY_BYTES, "the limit for an entry of compiled code"
    if cap is not None and cap < limit:
        limit, what = cap, "the cache's whole size cap"
    if size > limit:
        raise CacheEntryError(f"{where} is {size} bytes, more than {what} ({limit} bytes)")


def encode(entry: Entry) -> bytes:
    """The entry's unsigned bytes (MAGIC, header, files)."""
    names = sorted(entry.files)
    header = json.dumps({"key": entry.key, "fields": entry.fields, "files": [[n, len(entry.files[n])] for n in names],
                         "compile_seconds": entry.compile_seconds, "created": entry.created}, sort_keys=True).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header] + [entry.files[n] for n in names])


def read_header(data: bytes, where: str, total: Optional[int] = None) -> Header:
    """The validated header at the start of `data` (an entry, or at least its MAGIC, length and
    header); `total`: the whole entry's size when `data` holds only its start. CacheEntryError
    says what is wrong with anything that does not start like a valid entry."""
    total = len(data) if total is None else total
    if not data.startswith(MAGIC):
        raise CacheEntryError(f"{where} is not a Kiln cache entry (or not of this format version)")
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start:
        raise CacheEntryError(f"{where} is truncated ({len(data)} bytes)")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if length > MAX_HEADER_BYTES or start + length > total:
        raise CacheEntryError(f"{where} has a header length of {length} bytes, beyond its {total} bytes "
                              f"(or the {MAX_HEADER_BYTES}-byte limit): damaged or truncated")
    if len(data) < start + length:
        raise CacheEntryError(f"{where} is truncated in its header")
    try:
        raw = json.loads(data[start:start + length])
    except (ValueError, RecursionError) as exc:
        raise CacheEntryError(f"{where} has a damaged header ({type(exc).__name__})") from None
    header = _validated(raw, where, start + length)
    if header.body_end > total:
        raise CacheEntryError(f"{where} is truncated ({total} of at least {header.body_end} bytes)")
    return header


def folders(name: str) -> list[str]:
    """The folders a '/'-separated file name lies in: 'a/b/c' -> ['a', 'a/b']."""
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _validated(raw: Any, where: str, offset: int) -> Header:
    def bad(what: str) -> CacheEntryError:
        return CacheEntryError(f"{where} has a damaged header: {what}")

    if not isinstance(raw, dict):
        raise bad(f"a {type(raw).__name__}, not a mapping")
    missing = sorted({"key", "fields", "files"} - set(raw))
    if missing:
        raise bad(f"no {', '.join(missing)}")
    key, fields, files = raw["key"], raw["fields"], raw["files"]
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise bad(f"key {shorten(key)} is not an entry key (32 letters and digits)")
    if not isinstance(fields, dict) or _depth(fields) > MAX_FIELD_DEPTH:
        raise bad(f"fields {shorten(fields)} are not a mapping of at most {MAX_FIELD_DEPTH} levels")
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise bad(f"files {shorten(files)} are not a list of at most {MAX_FILES} [name, size] pairs")
    listed = []
    for item in files:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and type(item[1]) is int
                and item[1] >= 0):
            raise bad(f"file {shorten(item)} is not a [name, size >= 0] pair")
        if not _safe_relative(item[0]):
            raise bad(f"file name {shorten(item[0])} names a file outside its directory")
        if not _writable_name(item[0]):
            raise bad(f"file name {shorten(item[0])} is longer than a file system takes ({MAX_NAME_BYTES} bytes, "
                      f"{MAX_NAME_PART_BYTES} a part)")
        listed.append((item[0], item[1]))
    names = {name for name, _ in listed}
    if len(names) < len(listed):
        raise bad("a file is listed twice")
    clash = next((folder for name in names for folder in folders(name) if folder in names), None)
    if clash is not None:
        raise bad(f"{shorten(clash)} is listed as a file and as a folder of another")
    times = {}
    for name in ("compile_seconds", "created"):
        value = raw.get(name, 0.0)
        if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
            raise bad(f"{name} {shorten(value)} is not a number of seconds from 0 to {MAX_SECONDS}")
        times[name] = float(value)
    return Header(key, fields, tuple(listed), body_offset=offset, **times)


def _depth(value: Any) -> int:
    """How deeply `value` (parsed JSON) nests, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack += [(child, level + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _safe_relative(name: str) -> bool:
    """A '/'-separated path that stays inside the folder it is written to."""
    parts = name.split("/")
    return (bool(name) and "\0" not in name and "\\" not in name and not name.startswith("/")
            and not os.path.isabs(name) and ":" not in parts[0] and all(p not in ("", ".", "..") for p in parts))


def _writable_name(name: str) -> bool:
    """Short enough for a file system: the whole name and each of its parts, in bytes."""
    return (len(os.fsencode(name)) <= MAX_NAME_BYTES
            and all(len(os.fsencode(part)) <= MAX_NAME_PART_BYTES for part in name.split("/")))


def decode(data: bytes, where: str, signed_with: Optional[bytes]) -> Entry:
    """An Entry from signed bytes (`signed_with`: the key to check) or unsigned ones (None)."""
    return read_entry(io.BytesIO(data), len(data), where, signed_with)


def read_head(f: BinaryIO) -> bytes:
    """An entry's MAGIC, header length and header from the start of `f`: a bounded read (at most
    MAX_HEADER_BYTES of header), for read_header to check."""
    head = f.read(_START)
    if len(head) == _START and head.startswith(MAGIC):
        head += f.read(min(_LENGTH.unpack_from(head, len(MAGIC))[0], MAX_HEADER_BYTES))
    return head


def read_entry(f: BinaryIO, size: int, where: str, signed_with: Optional[bytes], cap: Optional[int] = None) -> Entry:
    """The Entry of `size` bytes at the start of `f`, signed (`signed_with`: the key to check) or not
    (None). Its MAGIC and header are read and checked first, then its size (exactly what its header
    lists, within its kind's limit and `cap`), and only then its files, each read once."""
    head = read_head(f)
    header = read_header(head, where, total=size)  # head is MAGIC, length and header: f is at the files
    check_size(size, where, cap)
    body = header.body_end
    expected = body + (trust.SIGNATURE_BYTES if signed_with is not None else 0)
    if signed_with is not None and size == body:
        raise CacheEntryError(f"{where} is unsigned: Kiln loads only entries it signed itself; bring entries from "
                              "elsewhere in with `kiln cache import`")
    if size < expected:
        raise CacheEntryError(f"{where} is truncated ({size} of {expected} bytes)")
    if size > expected:
        raise CacheEntryError(f"{where} has {size - expected} unexpected trailing bytes")
    mac = None
    if signed_with is not None:
        mac = trust.signer(signed_with)
        mac.update(head)
    files = {}
    for name, length in header.files:
        files[name] = f.read(length)
        if len(files[name]) != length:
            raise CacheEntryError(f"{where} is truncated in its file {shorten(name)} (changed while it was read?)")
        if mac is not None:
            mac.update(files[name])
    if mac is not None and not hmac.compare_digest(mac.digest(), f.read(trust.SIGNATURE_BYTES)):
        raise CacheEntryError(f"{where} fails its signature: it was changed after Kiln wrote it, or was written with "
                              "another user's or machine's key (copied in?); bring entries from elsewhere in with "
                              "`kiln cache import`")
    return header.entry(files=files, size=size)
