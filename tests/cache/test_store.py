"""The cache directory: trust (owner, mode, signature), integrity, atomic writes, LRU, export/import."""
import multiprocessing
import os

import pytest

from kiln.compiler.cache import CacheEntryError, CacheStore, CacheTrustError, Entry
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
        assert oct(os.stat(os.path.join(store.root, "signing.key")).st_mode & 0o777) == "0o600"
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
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    os.chmod(os.path.join(store.root, "signing.key"), 0o644)
    with pytest.raises(CacheTrustError, match="read or written by other users"):
        CacheStore(str(tmp_path), max_bytes=2**30)


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
    theirs = CacheStore(str(tmp_path / "theirs"), max_bytes=2**30)
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
    temp = os.path.join(store.entries, ".tmp-999-dead")
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
    assert not [n for n in os.listdir(store.entries) if n.startswith(".tmp-")]


def test_the_signing_key_is_made_once(tmp_path):
    first = CacheStore(str(tmp_path), max_bytes=2**30)
    first.write(entry())
    second = CacheStore(str(tmp_path), max_bytes=2**30)
    assert second.read("k" * 32) is not None


def test_work_dirs_of_dead_processes_are_removed(tmp_path, monkeypatch):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    base = os.path.join(store.root, "work")
    os.makedirs(os.path.join(base, "999999999-dead"))
    monkeypatch.setattr(store_module, "_alive", lambda pid: pid != 999999999)
    work = store.work_dir()
    assert os.path.isdir(work) and not os.path.exists(os.path.join(base, "999999999-dead"))
