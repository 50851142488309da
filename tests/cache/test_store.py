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


def _plant(store, written):
    """`written` signed with the store's key as it is, none of Kiln's write checks applied."""
    from kiln.compiler.cache import trust

    data = entry_module.encode(written)
    open(store.path(written.key), "wb").write(data + trust.sign(store._key, data))


def test_entry_paths_cannot_leave_the_work_directory(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    bad = entry()
    bad.files = {"../../escape.py": b"x"}
    with pytest.raises(CacheEntryError, match="outside its directory"):
        store.write(bad)  # never stored
    _plant(store, bad)
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


needs_flock = pytest.mark.skipif(store_module.fcntl is None, reason="work folders are locked with flock")


@needs_flock
def test_work_dirs_of_dead_processes_are_removed(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    base = os.path.join(store.root, "work")
    dead = os.path.join(base, "kiln-999999999-deadbeef")
    os.makedirs(dead)
    open(os.path.join(dead, ".kiln-work"), "w").write("999999999")  # its marker, locked by no process
    work = store.work_dir()
    assert os.path.isdir(work) and not os.path.exists(dead)
    assert open(os.path.join(os.path.dirname(work), ".kiln-work")).read() == str(os.getpid())
    again = CacheStore(str(tmp_path), max_bytes=2**30).work_dir()  # another store: this process's folder, kept
    assert os.path.dirname(again) == os.path.dirname(work) and os.path.isdir(work)


_HOLDER = """
import sys
from kiln.compiler.cache import store
print(store.CacheStore(sys.argv[1], 2**30).work_dir(), flush=True)
sys.stdin.read()  # lives until the test closes its input
"""


@needs_flock
def test_a_work_folder_is_removed_only_once_its_process_has_ended_whatever_its_id_here(tmp_path):
    """A container sharing the cache directory: its process ids are not this one's. Its live work
    folder, named for an id that names no process here, is kept while its process holds the marker."""
    import subprocess
    import sys

    root = str(tmp_path / "shared")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        theirs = os.path.dirname(holder.stdout.readline().decode().strip())
        elsewhere = os.path.join(os.path.dirname(theirs), "kiln-999999999-0badc0de")  # as if its id were 999999999
        os.rename(theirs, elsewhere)
        with open(os.path.join(elsewhere, ".kiln-work"), "r+b") as marker:
            marker.write(b"999999999")
        CacheStore(root, max_bytes=2**30).work_dir()
        assert os.path.isdir(elsewhere)  # its process holds the lock: in use
    finally:
        holder.communicate(b"", timeout=60)
    assert holder.returncode == 0
    store_module._remove_dead_work_dirs(os.path.dirname(elsewhere))  # as the next process's first work_dir does
    assert not os.path.exists(elsewhere)  # its process has ended


@needs_flock
def test_a_work_folder_another_process_removed_first_is_done(tmp_path, monkeypatch):
    """Two processes cleaning the same dead folder: the one that finds it gone goes on, with its cache."""
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    base = os.path.join(store.root, "work")
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: listdir(path) + (["kiln-999999999-deadbeef"] if path == base else []))
    assert os.path.isdir(store.work_dir())


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


def _within(seconds, call):
    """`call()`'s result, or its exception, from a thread; fails the test if it blocks past `seconds`."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001  handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_pipe_planted_as_an_entry_is_refused_not_waited_on(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    os.mkfifo(store.path("f" * 32), 0o600)
    with pytest.raises(CacheEntryError, match="not a regular file"):
        _within(10, lambda: store.read("f" * 32))
    [(key, listed, problem)] = _within(10, lambda: list(store.headers()))
    assert key == "f" * 32 and listed is None and "not a regular file" in problem
    _within(10, lambda: store.write(entry()))  # its eviction lists every entry file
    found, reason = _within(10, lambda: store_module.read_or_refuse(store, "f" * 32, "compiling it again"))
    assert found is None and "not a regular file" in reason and not os.path.lexists(store.path("f" * 32))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_pipe_planted_as_the_signing_key_is_refused_not_waited_on(tmp_path):
    key_path = tmp_path / "config" / "key"
    key_path.parent.mkdir(mode=0o700)
    os.mkfifo(key_path, 0o600)
    with pytest.raises(CacheTrustError, match="not a regular file"):
        _within(10, lambda: CacheStore(str(tmp_path / "cache"), max_bytes=2**30, key_path=str(key_path)))


@needs_flock
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_pipe_planted_as_a_work_folders_marker_is_left_alone(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    planted = os.path.join(store.root, "work", "kiln-999999999-deadbeef")
    os.makedirs(planted)
    os.mkfifo(os.path.join(planted, ".kiln-work"))
    assert os.path.isdir(_within(10, store.work_dir)) and os.path.isdir(planted)


@posix_only
def test_listing_never_follows_a_link(tmp_path):
    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    store.write(entry())
    os.rename(store.path("k" * 32), tmp_path / "elsewhere.kiln")
    os.symlink(tmp_path / "elsewhere.kiln", store.path("k" * 32))
    [(_, listed, problem)] = list(store.headers())
    assert listed is None and "symbolic link" in problem


def _sparse(store, key, claimed):
    """A sparse file at `key`: MAGIC and a header (unsigned) listing one file of `claimed` bytes, then that many."""
    import json
    import struct

    text = json.dumps(dict(GOOD_HEADER, key=key, files=[["fxgraph/a", claimed]])).encode()
    with open(store.path(key), "wb") as f:
        f.write(entry_module.MAGIC + struct.pack(">Q", len(text)) + text)
        f.truncate(len(entry_module.MAGIC) + 8 + len(text) + claimed)


class _Counting:
    """A file that counts the bytes read from it."""

    def __init__(self, f):
        self.f, self.bytes_read = f, 0

    def read(self, n=-1):
        data = self.f.read(n)
        self.bytes_read += len(data)
        return data


def test_an_entry_past_its_limit_is_refused_before_its_files_are_read(tmp_path, monkeypatch):
    """A sparse file planted at an entry's key once was read whole into memory:
    up to the cache's whole size cap (20 GiB by default)."""
    store = CacheStore(str(tmp_path), max_bytes=2**40)
    _sparse(store, "k" * 32, entry_module.MAX_ENTRY_BYTES + 1)
    counted = []
    real_read_entry = store_module.read_entry
    monkeypatch.setattr(store_module, "read_entry",
                        lambda f, *args, **kwargs: real_read_entry(counted.append(_Counting(f)) or counted[0], *args, **kwargs))
    with pytest.raises(CacheEntryError, match=f"more than the limit for an entry of compiled code "
                                              f"\\({entry_module.MAX_ENTRY_BYTES} bytes\\)"):
        store.read("k" * 32)
    assert counted[0].bytes_read < 1024  # its MAGIC, length and header: nothing more


def test_an_entry_has_its_limit_within_the_caches_cap(tmp_path):
    entry_module.check_size(entry_module.MAX_ENTRY_BYTES, "entry")
    with pytest.raises(CacheEntryError, match="more than the limit for an entry"):
        entry_module.check_size(entry_module.MAX_ENTRY_BYTES + 1, "entry")
    with pytest.raises(CacheEntryError, match="more than the cache's whole size cap \\(1000 bytes\\)"):
        entry_module.check_size(1001, "entry", cap=1000)
    # what real entries are: compiled graphs up to 17.3 MiB measured
    assert entry_module.MAX_ENTRY_BYTES >= 16 * 17.3 * 2**20


def test_an_entry_past_its_limit_is_never_written(tmp_path, monkeypatch):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    monkeypatch.setattr(entry_module, "MAX_ENTRY_BYTES", 500)
    with pytest.raises(CacheEntryError, match="more than the limit for an entry of compiled code"):
        store.write(entry(size=1000))
    assert store.keys() == []


def test_eviction_reads_no_entry_and_counts_every_entry_file(tmp_path, monkeypatch):
    """Eviction once parsed every entry's header (planted ones up to 16 MiB each, kept all at once):
    4 such files made one write take 10 s and 650 MiB. It now goes by names and sizes only."""
    store = CacheStore(str(tmp_path), max_bytes=30_000)
    for i, key in enumerate("abc"):
        store.write(entry(key * 32, size=10_000))
        os.utime(store.path(key * 32), (1000 + i, 1000 + i))
    open(store.path("d" * 32), "wb").write(b"\0" * 10_000)  # no entry at all: still counted, and oldest
    os.utime(store.path("d" * 32), (999, 999))

    def no_reading(*args, **kwargs):
        raise AssertionError("eviction read an entry")

    monkeypatch.setattr(store_module.trust, "open_private", no_reading)
    monkeypatch.setattr(store_module, "read_head", no_reading)
    store.write(entry("e" * 32, size=10_000))
    assert sorted(store.keys()) == ["c" * 32, "e" * 32]


def test_listing_reads_each_header_only_as_it_is_listed(tmp_path, monkeypatch):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    for key in "abc":
        store.write(entry(key * 32))
    opened = []
    real_open = store_module.trust.open_private
    monkeypatch.setattr(store_module.trust, "open_private", lambda path, what: opened.append(path) or real_open(path, what))
    listing = store.headers()
    next(listing)
    assert len(opened) == 1
    assert entry_module.MAX_HEADER_BYTES <= 4 * 2**20  # what one listed header may cost


def test_a_header_past_its_limit_is_listed_as_a_problem_unread(tmp_path):
    import json
    import struct

    store = CacheStore(str(tmp_path), max_bytes=2**30)
    text = json.dumps(dict(GOOD_HEADER, fields={"x": "y" * entry_module.MAX_HEADER_BYTES})).encode()
    open(store.path("k" * 32), "wb").write(entry_module.MAGIC + struct.pack(">Q", len(text)) + text)
    [(_, listed, problem)] = list(store.headers())
    assert listed is None and "header length" in problem


def _tar(path, members, mode="w"):
    """A tar file of (name, bytes) members."""
    import io
    import tarfile

    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _exported(key, size=1000):
    return (key + ".kiln", entry_module.encode(entry(key, size=size)))


def test_import_refuses_a_compressed_file_without_inflating_it(tmp_path, monkeypatch):
    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    bundle = _tar(tmp_path / "x.tar.gz", [_exported("k" * 32)], mode="w:gz")
    import zlib

    monkeypatch.setattr(zlib, "decompressobj", lambda *a, **k: pytest.fail("a compressed file was inflated"))
    with pytest.raises(CacheEntryError, match="not a whole file made by `kiln cache export`.*uncompressed tar"):
        store.import_(bundle)
    assert store.keys() == []


def test_import_of_a_truncated_or_damaged_file_says_so_and_what_it_imported(tmp_path):
    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    bundle = _tar(tmp_path / "x.tar", [_exported("a" * 32), _exported("b" * 32, size=100_000)])
    data = open(bundle, "rb").read()
    open(bundle, "wb").write(data[:len(data) // 2])
    with pytest.raises(CacheEntryError, match="not a whole file made by `kiln cache export` .*unexpected end of data"):
        store.import_(bundle)  # found before anything is stored
    assert store.keys() == []
    name, damaged = _exported("b" * 32)
    bundle = _tar(tmp_path / "y.tar", [_exported("a" * 32), (name, damaged[:-10])])
    with pytest.raises(CacheEntryError, match="truncated.*; the 1 entries before it were imported"):
        store.import_(bundle)
    assert store.keys() == ["a" * 32]


def test_import_checks_a_members_size_and_magic_before_reading_it(tmp_path, monkeypatch):
    import tarfile

    store = CacheStore(str(tmp_path / "c"), max_bytes=2**40)
    largest = entry_module.MAX_ENTRY_BYTES
    bundle = tmp_path / "big.tar"
    with tarfile.open(bundle, "w") as tar:  # a member claiming more than any entry: a sparse file behind it
        info = tarfile.TarInfo("k" * 32 + ".kiln")
        info.size = largest + 1
        tar.addfile(info)
    with open(bundle, "r+b") as f:
        f.truncate(512 + largest + 1 + 2048)
    with pytest.raises(CacheEntryError, match=f"is {largest + 1} bytes, more than the largest entry this cache takes"):
        store.import_(str(bundle))
    reads = []
    real = tarfile.ExFileObject.read
    monkeypatch.setattr(tarfile.ExFileObject, "read", lambda self, n=-1: reads.append(n) or real(self, n))
    not_an_entry = _tar(tmp_path / "pickle.tar", [("k" * 32 + ".kiln", b"\x80\x04" + b"\0" * 100_000)])
    with pytest.raises(CacheEntryError, match="not a Kiln cache entry"):
        store.import_(not_an_entry)
    assert sum(reads) < 100  # its start: no more


def test_import_refuses_a_tar_record_tarfile_would_read_whole(tmp_path):
    import tarfile

    bundle = tmp_path / "pax.tar"
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        name, data = _exported("k" * 32)
        info = tarfile.TarInfo(name)
        info.size, info.pax_headers = len(data), {"comment": "x" * 1000}
        import io

        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CacheEntryError, match="not a Kiln cache entry"):
        CacheStore(str(tmp_path / "c"), max_bytes=2**30).import_(str(bundle))


def test_an_import_past_the_size_cap_is_refused_naming_sizes(tmp_path):
    """It once evicted its own first entries, and said it had imported them."""
    bundle = _tar(tmp_path / "x.tar", [_exported(key * 32, size=2000) for key in "abc"])
    store = CacheStore(str(tmp_path / "c"), max_bytes=5000)
    with pytest.raises(CacheEntryError, match=r"holds 3 entries of \d+ bytes in all .*size cap \(5000 bytes\): nothing "
                                              "imported"):
        store.import_(bundle)
    assert store.keys() == []


def test_an_import_reports_only_what_the_cache_holds_at_the_end(tmp_path, monkeypatch):
    bundle = _tar(tmp_path / "x.tar", [_exported(key * 32) for key in "ab"])
    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    real_write = store.write

    def write_then_lose_a(written):  # as if another process evicted it meanwhile
        size = real_write(written)
        store.remove("a" * 32)
        return size

    monkeypatch.setattr(store, "write", write_then_lose_a)
    assert [e.key for e in store.import_(bundle)] == ["b" * 32]


def test_export_writes_what_import_reads(tmp_path):
    import tarfile

    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    store.write(entry())
    bundle = str(tmp_path / "x.tar")
    store.export([], bundle)
    with tarfile.open(bundle, "r:") as tar:
        assert [m.type for m in tar.getmembers()] == [tarfile.REGTYPE]
    assert [e.key for e in CacheStore(str(tmp_path / "other"), max_bytes=2**30).import_(bundle)] == ["k" * 32]


@pytest.mark.parametrize("created", [1e300, -1.0, entry_module.MAX_SECONDS + 1])
def test_a_time_out_of_range_is_refused(tmp_path, created):
    """created=1e300 once passed, and `kiln cache info` and `export` then died on it."""
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    _plant(store, Entry(key="k" * 32, fields={"graph": "g"}, files={"fxgraph/a": b"x"}, created=created))
    with pytest.raises(CacheEntryError, match="created .* is not a number of seconds from 0 to"):
        store.read("k" * 32)


@pytest.mark.parametrize("files, problem", [
    ({"fxgraph/a": b"1", "fxgraph/a/b": b"2"}, "'fxgraph/a' is listed as a file and as a folder of another"),
    ({"fxgraph/" + "x" * 256: b"1"}, "longer than a file system takes"),
    ({"/".join(["x" * 200] * 6): b"1"}, "longer than a file system takes"),
])
def test_file_names_that_cannot_all_be_written_are_refused(tmp_path, files, problem):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    bad = Entry(key="k" * 32, fields={"graph": "g"}, files=files, created=1.0)
    with pytest.raises(CacheEntryError, match=problem):
        store.write(bad)
    _plant(store, bad)
    with pytest.raises(CacheEntryError, match=problem):
        store.read("k" * 32)


def test_a_file_listed_twice_is_refused(tmp_path):
    store = CacheStore(str(tmp_path), max_bytes=2**30)
    data = _raw_entry(store, dict(GOOD_HEADER, files=[["fxgraph/a", 2], ["fxgraph/a", 2]]), body=b"abcd")
    open(store.path("k" * 32), "wb").write(data)
    with pytest.raises(CacheEntryError, match="listed twice"):
        store.read("k" * 32)


@posix_only
def test_folders_kiln_makes_above_its_cache_are_private_whatever_the_umask(tmp_path):
    """Under umask 002 (user-private groups) the folders made on the way were 0775, and Kiln then
    refused its own directory every time."""
    old = os.umask(0o002)
    try:
        for _ in range(2):
            store = CacheStore(str(tmp_path / "home" / ".cache" / "kiln"), max_bytes=2**30,
                               key_path=str(tmp_path / "home" / ".config" / "kiln" / "key"))
    finally:
        os.umask(old)
    for folder in ("home", "home/.cache", "home/.config", "home/.cache/kiln", "home/.config/kiln"):
        assert oct(os.stat(tmp_path / folder).st_mode & 0o777) == "0o700", folder
    assert store.read("m" * 32) is None
