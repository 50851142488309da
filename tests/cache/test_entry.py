"""An entry's bytes read as untrusted data: random bytes and random JSON headers are refused with
CacheEntryError, never another error."""
import json
import random
import struct

from kiln.compiler.cache import CacheEntryError
from kiln.compiler.cache import entry as entry_module

GOOD_HEADER = {"key": "k" * 32, "fields": {"graph": "g"}, "files": [["fxgraph/a", 4]], "compile_seconds": 1.0,
               "created": 1.0}


def _random_json(rng, depth=0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 1, 2**70, rng.randrange(-10**6, 10**6)])
    if kind == 2:
        return rng.choice([0.5, -1.5, float("inf"), float("nan"), 1e308])
    if kind in (3, 4):
        return rng.choice(["", "k" * 32, "../x", "fxgraph/a", "\x00", "a/../../b", "C:/x", "é" * 3])
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    names = ["key", "fields", "files", "compile_seconds", "created", "x"]
    return {rng.choice(names): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_fuzz_the_header_reader_only_refuses():
    """Random bytes and random JSON headers: the only error out of the reader is CacheEntryError."""
    rng = random.Random(0)
    outcomes = {"read": 0, "refused": 0}
    for case in range(3000):
        if case % 3 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            data = entry_module.MAGIC + data if case % 2 else data
        else:
            header = _random_json(rng) if case % 3 == 1 else dict(GOOD_HEADER, **{
                rng.choice(list(GOOD_HEADER)): _random_json(rng)})
            text = json.dumps(header, allow_nan=True).encode()
            length = len(text) if rng.random() < 0.8 else rng.choice([0, 2**63, len(text) + 1, 2**32])
            data = entry_module.MAGIC + struct.pack(">Q", length) + text + bytes(rng.randrange(16))
        for read in (lambda: entry_module.read_header(data, "fuzz"),
                     lambda: entry_module.decode(data, "fuzz", signed_with=None),
                     lambda: entry_module.decode(data, "fuzz", signed_with=b"k" * 32)):
            try:
                read()
                outcomes["read"] += 1
            except CacheEntryError:
                outcomes["refused"] += 1
    assert outcomes["refused"] > 5000 and outcomes["read"] > 20  # both paths were exercised


class _Endless:
    """A file of `size` bytes that starts with `start`, then zeros; counts what is read from it."""

    def __init__(self, start: bytes, size: int):
        self.start, self.size, self.position, self.bytes_read = start, size, 0, 0

    def read(self, n=-1):
        n = self.size - self.position if n < 0 else min(n, self.size - self.position)
        data = (self.start[self.position:self.position + n]).ljust(n, b"\0")
        self.position += n
        self.bytes_read += n
        return data


def test_an_entry_is_checked_from_its_start_before_the_rest_is_read():
    """An entry file was read whole before its first bytes were looked at."""
    import pytest

    garbage = _Endless(b"\x80\x04 a pickle", 2**40)
    with pytest.raises(CacheEntryError, match="not a Kiln cache entry"):
        entry_module.read_entry(garbage, 2**40, "planted", signed_with=b"k" * 32)
    assert garbage.bytes_read <= len(entry_module.MAGIC) + 8
    text = json.dumps(dict(GOOD_HEADER, files=[["fxgraph/a", 2**40]])).encode()
    claimed = _Endless(entry_module.MAGIC + struct.pack(">Q", len(text)) + text, 2**41)
    with pytest.raises(CacheEntryError, match="more than the limit for an entry of compiled code"):
        entry_module.read_entry(claimed, 2**41, "planted", signed_with=b"k" * 32)
    assert claimed.bytes_read == len(entry_module.MAGIC) + 8 + len(text)
