"""The cache directory: trust (owner, mode, signature), integrity, atomic writes, LRU, export/import."""
import multiprocessing
import os

import pytest

from kiln.compiler.cache import CacheEntryError, CacheStore, CacheTrustError, Entry
from kiln.compiler.cache import entry as entry_module
from kiln.compiler.cache import store as store_module

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX owners and modes")


def entry(key="k" * 32, size=1000, label="M graph 0") -> Entry:
    return Entry(key=key, fields={"graph": "g", "label": label}, files={"fxgraph/a/b": os.urandom(size), "x.so": b"elf"},
                 compile_seconds=12.5)


def test_round_trip_and_private_modes(tmp_path):
    store = CacheStore(str(tmp_path / "cache"), max_bytes=2**30)
    size = store.write(entry())
    got = store.read("k" * 32)
    assert len(got.files["fxgraph/a/b"]) == 1000 and got.files["x.so"] == b"elf"
    assert got.fields["label"] == "M graph 0" and got.compile_seconds == 12.5 and got.size == size
    if os.name == "posix":
        assert oct(os.stat(store.root).st_mode & 0o777) == "0o700"
        assert oct(os.stat(store.key_path).st_mode & 0o777) == "0o600"
        assert oct(os.stat(store.path("k" * 32)).st_mode & 0o777) == "0o600"
    assert store.read("m" * 32) is None


def test_files_come_back_byte_for_byte(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    written = entry()
    store.write(written)
    assert store.read(written.key).files == written.files


@posix_only
def test_a_directory_others_can_write_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(CacheTrustError, match="can be written by other users.*chmod 700"):
        CacheStore(str(root), max_bytes=2**30)


@posix_only
@pytest.mark.skipif(os.name == "posix" and os.getuid() != 0, reason="needs root to give a file to another user")
def test_a_directory_or_entry_of_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(CacheTrustError, match="belongs to uid 12345"):
        CacheStore(str(root), max_bytes=2**30)
    store = CacheStore(str(tmp_path / "mine"), max_bytes=2**30)
    store.write(entry())
    os.chown(store.path("k" * 32), 12345, 12345)
    with pytest.raises(CacheEntryError, match="belongs to uid 12345"):
        store.read("k" * 32)


@posix_only
def test_a_key_others_can_read_is_refused(tmp_path):
    key_path = str(tmp_path / "config" / "key")
    CacheStore(str(tmp_path / "cache"), max_bytes=2**30, key_path=key_path)
    os.chmod(key_path, 0o644)
    with pytest.raises(CacheTrustError, match="read or written by other users"):
        CacheStore(str(tmp_path / "cache"), max_bytes=2**30, key_path=key_path)


def _damage(path, how):
    data = open(path, "rb").read()
    if how == "flip":
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]
    elif how == "truncate":
        data = data[:len(data) // 2]
    elif how == "unsign":
        data = data[:-32]
    elif how == "garbage":
        data = b"\x80\x04 not an entry"
    open(path, "wb").write(data)


@pytest.mark.parametrize("how, message", [("flip", "fails its signature"), ("truncate", "truncated"),
                                          ("unsign", "unsigned"), ("garbage", "not a Kiln cache entry")])
def test_damaged_entries_are_refused_with_a_reason(tmp_path, how, message):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    store.write(entry())
    _damage(store.path("k" * 32), how)
    with pytest.raises(CacheEntryError, match=message):
        store.read("k" * 32)


def test_an_entry_copied_from_another_cache_is_refused_until_imported(tmp_path):
    theirs = CacheStore(str(tmp_path / "theirs"), max_bytes=2**30, key_path=str(tmp_path / "their-config" / "key"))
    mine = CacheStore(str(tmp_path / "mine"), max_bytes=2**30)
    theirs.write(entry())
    with open(theirs.path("k" * 32), "rb") as src, open(mine.path("k" * 32), "wb") as dst:
        dst.write(src.read())
    with pytest.raises(CacheEntryError, match="another user's or machine's key.*kiln cache import"):
        mine.read("k" * 32)
    bundle = str(tmp_path / "bundle.tar")
    assert theirs.export([], bundle) == 1
    imported = mine.import_(bundle)
    assert [e.key for e in imported] == ["k" * 32]
    assert mine.read("k" * 32).files == theirs.read("k" * 32).files


def test_renamed_entry_is_refused(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    store.write(entry())
    os.replace(store.path("k" * 32), store.path("z" * 32))
    with pytest.raises(CacheEntryError, match="holds the entry k"):
        store.read("z" * 32)


def test_import_refuses_a_file_that_is_not_an_export(tmp_path):
    import tarfile

    bad = tmp_path / "bad.tar"
    payload = tmp_path / "evil.py"
    payload.write_text("print('hi')")
    with tarfile.open(bad, "w") as tar:
        tar.add(payload, arcname="evil.py")
    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    with pytest.raises(CacheEntryError, match="not a Kiln cache entry"):
        store.import_(str(bad))
    assert list(store.headers()) == []


def test_entry_paths_cannot_leave_the_work_directory(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    bad = entry()
    bad.files = {"../../escape.py": b"x"}
    store.write(bad)
    with pytest.raises(CacheEntryError, match="outside its directory"):
        store.read(bad.key)


def test_least_recently_used_entries_are_evicted_past_the_cap(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    for i, key in enumerate("abc"):
        store.write(entry(key * 32, size=10_000))
        os.utime(store.path(key * 32), (1000 + i, 1000 + i))
    store.read("a" * 32)  # used now: newest
    store.max_bytes = 2 * os.path.getsize(store.path("a" * 32)) + 10
    dropped = store.evict()
    assert dropped == ["b" * 32]
    assert sorted(key for key, _, _ in store.headers()) == ["a" * 32, "c" * 32]


def test_a_crashed_writers_temp_file_is_cleaned_and_never_listed(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    temp = os.path.join(store.entries, ".kiln-tmp-999-deadbeef")
    open(temp, "wb").write(b"half")
    assert list(store.headers()) == []
    os.utime(temp, (0, 0))
    store.evict()
    assert not os.path.exists(temp)


def _writer(root, worker):
    store = CacheStore(root, max_bytes=2**30)
    for i in range(20):
        store.write(entry(f"{i % 5:032d}", size=50_000 + worker))


def test_two_processes_writing_at_once_leave_a_valid_cache(tmp_path):
    root = str(tmp_path / "shared")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(root, n)) for n in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    store = CacheStore(root, max_bytes=2**30)
    keys = sorted(key for key, _, _ in store.headers())
    assert keys == [f"{i:032d}" for i in range(5)]
    for key in keys:
        assert len(store.read(key).files["fxgraph/a/b"]) in (50_000, 50_001)
    assert not [n for n in os.listdir(store.entries) if n.startswith(".kiln-tmp-")]


def test_the_signing_key_is_made_once(tmp_path):
    first = CacheStore(str(tmp_path), max_bytes=2**30)
    first.write(entry())
    second = CacheStore(str(tmp_path), max_bytes=2**30)
    assert second.read("k" * 32) is not None


def test_work_dirs_of_dead_processes_are_removed(tmp_path, monkeypatch):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    base = os.path.join(store.root, "work")
    dead = os.path.join(base, "kiln-999999999-deadbeef")
    os.makedirs(dead)
    open(os.path.join(dead, ".kiln-work"), "w").write("999999999")
    monkeypatch.setattr(store_module, "_alive", lambda pid: pid != 999999999)
    work = store.work_dir()
    assert os.path.isdir(work) and not os.path.exists(dead)
    assert open(os.path.join(os.path.dirname(work), ".kiln-work")).read() == str(os.getpid())


def test_a_users_folders_in_the_cache_directory_are_never_removed(tmp_path, monkeypatch):
    """A workflow once named the home directory as cache_dir, and every folder under ~/work whose
    name began with digits was deleted. Only Kiln's own work folders, named and marked by Kiln, go."""
    home = tmp_path / "home"
    precious = ["2024-taxes", "1999", "12345", "kiln-999999999-deadbeef"]  # the last: Kiln's name, no marker
    for name in precious:
        (home / "work" / name).mkdir(parents=True)
        (home / "work" / name / "keep.txt").write_text(name)
    (home / "work" / "kiln-999999998-deadbeef").mkdir()
    (home / "work" / "kiln-999999998-deadbeef" / ".kiln-work").write_text("1")  # a marker for another process
    (home / "entries").mkdir()
    (home / "entries" / ".tmp-1-x").write_text("mine")
    os.utime(home / "entries" / ".tmp-1-x", (0, 0))
    monkeypatch.setattr(store_module, "_alive", lambda pid: False)
    store = CacheStore(str(home), max_bytes=2**30)
    store.work_dir()
    store.write(entry())
    store.evict()
    for name in precious:
        assert (home / "work" / name / "keep.txt").read_text() == name
    assert (home / "work" / "kiln-999999998-deadbeef" / ".kiln-work").exists()
    assert (home / "entries" / ".tmp-1-x").read_text() == "mine"


def test_the_signing_key_is_not_in_the_cache_directory(tmp_path):
    """A key beside the entries would let whoever can write the directory sign their own code."""
    store = CacheStore(str(tmp_path / "cache"), max_bytes=2**30)
    store.write(entry())
    assert not os.path.commonpath([store.key_path, store.root]) == store.root
    assert os.path.dirname(store.key_path) == os.path.join(os.environ["XDG_CONFIG_HOME"], "kiln")
    assert not [name for name in os.listdir(store.root) if "key" in name]
    planted = tmp_path / "cache" / "signing.key"  # an attacker's key where Kiln once kept its own
    planted.write_bytes(b"\0" * 32)
    os.chmod(planted, 0o600)
    forged = entry("f" * 32)
    from kiln.compiler.cache import trust
    data = entry_module.encode(forged)
    open(store.path("f" * 32), "wb").write(data + trust.sign(b"\0" * 32, data))
    with pytest.raises(CacheEntryError, match="fails its signature"):
        store.read("f" * 32)


@posix_only
def test_symbolic_links_are_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    store = CacheStore(str(real), max_bytes=2**30)
    os.rename(store.entries, str(real / "elsewhere"))
    os.symlink(real / "elsewhere", store.entries)
    with pytest.raises(CacheTrustError, match="symbolic link"):
        CacheStore(str(real), max_bytes=2**30)
    os.unlink(store.entries)
    os.rename(str(real / "elsewhere"), store.entries)
    store.write(entry())
    target = tmp_path / "target.kiln"
    os.rename(store.path("k" * 32), target)
    os.symlink(target, store.path("k" * 32))
    with pytest.raises(CacheEntryError, match="symbolic link"):
        store.read("k" * 32)


@posix_only
def test_a_directory_in_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky: anyone could rename our directory away and put theirs in
    with pytest.raises(CacheTrustError, match="lies in .*shared, which other users can write"):
        CacheStore(str(shared / "cache"), max_bytes=2**30)
    os.chmod(shared, 0o1777)  # sticky, like /tmp: only the owner may rename or remove what is in it
    assert CacheStore(str(shared / "cache"), max_bytes=2**30).root == str(shared / "cache")


def _raw_entry(store, header, body=b"", length=None):
    """Entry bytes with `header` as written, signed with the store's own key: only the header is bad."""
    import json
    import struct

    from kiln.compiler.cache import trust

    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    data = entry_module.MAGIC + struct.pack(">Q", len(text) if length is None else length) + text + body
    return data + trust.sign(store._key, data)


def _nested(levels):
    return {"a": _nested(levels - 1)} if levels else 1


GOOD_HEADER = {"key": "k" * 32, "fields": {"graph": "g"}, "files": [["fxgraph/a", 4]], "compile_seconds": 1.0,
               "created": 1.0}
BAD_HEADERS = {
    "no key": {k: v for k, v in GOOD_HEADER.items() if k != "key"},
    "fields a list": dict(GOOD_HEADER, fields=[1, 2]),
    "files a mapping": dict(GOOD_HEADER, files={"a": 4}),
    "negative size": dict(GOOD_HEADER, files=[["fxgraph/a", -4]]),
    "size beyond the file": dict(GOOD_HEADER, files=[["fxgraph/a", 10**15]]),
    "a size that is no integer": dict(GOOD_HEADER, files=[["fxgraph/a", 4.5]]),
    "a key that is a path": dict(GOOD_HEADER, key="../../../../etc/passwd"),
    "compile_seconds not finite": b'{"key": "' + b"k" * 32 + b'", "fields": {}, "files": [], "compile_seconds": NaN}',
    "fields nested deep": dict(GOOD_HEADER, fields=_nested(12)),
    "JSON nested 5000 deep": b"[" * 5000 + b"]" * 5000,
    "not JSON": b"\x80\x81 not json",
    "a list": b"[1, 2, 3]",
}


@pytest.mark.parametrize("what", list(BAD_HEADERS))
def test_a_bad_header_is_refused_by_read_list_and_import(tmp_path, what):
    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    data = _raw_entry(store, BAD_HEADERS[what], body=b"code")
    open(store.path("k" * 32), "wb").write(data)
    with pytest.raises(CacheEntryError, match="damaged header|truncated"):
        store.read("k" * 32)
    [(key, listed, problem)] = list(store.headers())
    assert key == "k" * 32 and listed is None and ("damaged header" in problem or "truncated" in problem)
    bundle = tmp_path / "bundle.tar"
    import io
    import tarfile

    with tarfile.open(bundle, "w") as tar:
        info = tarfile.TarInfo("k" * 32 + ".kiln")
        info.size = len(data) - 32
        tar.addfile(info, io.BytesIO(data[:-32]))
    with pytest.raises(CacheEntryError):
        CacheStore(str(tmp_path / "other"), max_bytes=2**30).import_(str(bundle))
    assert list(CacheStore(str(tmp_path / "other"), max_bytes=2**30).headers()) == []


def test_an_absurd_header_length_is_refused_without_reading_it(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    open(store.path("k" * 32), "wb").write(_raw_entry(store, GOOD_HEADER, body=b"code", length=2**63))
    with pytest.raises(CacheEntryError, match="header length of 9223372036854775808 bytes"):
        store.read("k" * 32)
    assert "header length" in list(store.headers())[0][2]


def test_an_entry_larger_than_the_cap_is_not_read(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    store.write(entry())
    store.max_bytes = 100
    with pytest.raises(CacheEntryError, match="more than the cache's whole size cap"):
        store.read("k" * 32)


def test_on_windows_the_log_says_once_what_is_not_checked(tmp_path, monkeypatch, caplog):
    import logging

    from kiln.compiler.cache import trust

    monkeypatch.setattr(trust, "_posix", lambda: False)
    monkeypatch.setattr(trust, "_said_what_windows_leaves_unchecked", False)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        CacheStore(str(tmp_path / "a"), max_bytes=2**30).write(entry())
        CacheStore(str(tmp_path / "b"), max_bytes=2**30)
    assert caplog.text.count("does not check the cache directory's owner or ACL") == 1
