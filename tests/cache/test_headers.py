"""Inductor's precompiled C++ headers under Kiln's cache: the headers a process built are kept as a
signed entry and written back into Inductor's folder when a later process finds them gone (a cleared
temporary folder), so it builds none; files already there are left as they are; a bad entry, a folder
others could change, or torch without precompiled headers never stops a compile."""
import logging
import os
import stat
import subprocess
import sys
import time

import pytest

from kiln.compiler import compat
from kiln.compiler.cache import CacheOptions, CacheStore, Entry, GraphCache, cpu_probe, entry_key, headers

HEADER, GCH = "cabc123.h", "cabc123.h.gch"
DONE = b"gpch+014 a precompiled header"  # a finished .gch starts with gcc's mark


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """Inductor's header folder, in a new process (nothing seen in it yet)."""
    path = tmp_path / "torchinductor_me" / "precompiled_headers"
    monkeypatch.setattr(compat, "inductor_header_dir", lambda: str(path))
    new_process(monkeypatch)
    return path


def new_process(monkeypatch):
    """A process that loads Kiln now: what the folder holds was built before it."""
    for name, value in (("_found", None), ("_kept", {}), ("_refused", ""), ("_said_clang", False),
                        ("_loaded_ns", time.time_ns())):
        monkeypatch.setattr(headers, name, value)


def build(folder, name=GCH, data=DONE):
    """As Inductor's build does: a precompiled header in its folder, beside the `.h` it asked for."""
    ask(folder, name)
    (folder / name).write_bytes(data)


def ask(folder, name=GCH):
    """As Inductor does whenever it asks for a header, built or not: it writes the header's `.h`."""
    os.makedirs(folder, exist_ok=True)
    (folder / name[:-len(".gch")]).write_bytes(b"#include <torch/csrc/inductor/cpp_prefix.h>\n")


def store(tmp_path) -> CacheStore:
    return CacheOptions(dir=str(tmp_path / "cache")).open()


def kept_then_gone(tmp_path, folder, monkeypatch):
    """A header one process built and kept; the next process, whose folder was cleared, has not looked yet."""
    headers.restore(store(tmp_path))
    build(folder, GCH)
    headers.keep_new(store(tmp_path))
    new_process(monkeypatch)
    clear(folder)


def clear(folder):
    for name in os.listdir(folder):
        os.remove(folder / name)


def kept(tmp_path):
    entry = store(tmp_path).read(entry_key(headers.header_fields()))
    return None if entry is None else entry.files


def test_headers_a_process_built_are_kept_and_written_back_when_gone(tmp_path, folder, monkeypatch, caplog):
    headers.restore(store(tmp_path))
    build(folder, GCH)
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.keep_new(store(tmp_path))
    assert kept(tmp_path) == {GCH: DONE} and f"stored {GCH} in Kiln's cache" in caplog.text

    new_process(monkeypatch)  # after a reboot cleared the temporary folder
    for name in (HEADER, GCH):
        os.remove(folder / name)
    os.rmdir(folder)
    os.rmdir(folder.parent)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.restore(store(tmp_path))
    assert (folder / GCH).read_bytes() == DONE and f"wrote {GCH} back from Kiln's cache" in caplog.text
    if os.name == "posix":
        for path in (folder.parent, folder):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(folder / GCH).st_mode) == 0o600
    assert os.listdir(folder) == [GCH]  # no temporary file left, and only the .gch: Inductor writes its .h
    ask(folder)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.keep_new(store(tmp_path))  # written back, not built: nothing new to store
    assert "stored" not in caplog.text


def test_headers_built_by_separate_lowerings_are_all_kept(tmp_path, folder, monkeypatch):
    headers.restore(store(tmp_path))
    build(folder, GCH)
    headers.keep_new(store(tmp_path))
    build(folder, "cwrapper.h.gch", b"gpch another header")
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) == {GCH: DONE, "cwrapper.h.gch": b"gpch another header"}
    new_process(monkeypatch)
    clear(folder)
    headers.restore(store(tmp_path))
    ask(folder, GCH)
    ask(folder, "cwrapper.h.gch")
    build(folder, "cthird.h.gch", b"gpch a third")
    headers.keep_new(store(tmp_path))  # the written-back ones Inductor asked for stay, with the new one
    assert sorted(kept(tmp_path)) == sorted([GCH, "cwrapper.h.gch", "cthird.h.gch"])


def test_an_older_compilers_header_drops_out_after_an_update(tmp_path, folder, monkeypatch):
    """After a compiler update and a clearing: the old header is written back (Kiln cannot know it is
    stale), Inductor asks for and builds the new compiler's, and the entry keeps only that one."""
    headers.restore(store(tmp_path))
    build(folder, GCH)
    headers.keep_new(store(tmp_path))
    new_process(monkeypatch)
    clear(folder)
    headers.restore(store(tmp_path))
    assert os.listdir(folder) == [GCH]
    build(folder, "cnewcompiler.h.gch", b"gpch the new compiler's")  # Inductor's name hashes the compiler
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) == {"cnewcompiler.h.gch": b"gpch the new compiler's"}


def test_headers_already_there_are_neither_replaced_nor_stored_and_each_cache_is_restored_once(
        tmp_path, folder, monkeypatch):
    headers.restore(store(tmp_path))
    build(folder, GCH, b"gpch kept")
    headers.keep_new(store(tmp_path))
    build(folder, GCH, b"gpch built by another process before this one")
    build(folder, "cother.h.gch", b"gpch another torch's")
    new_process(monkeypatch)
    headers.restore(store(tmp_path))
    assert (folder / GCH).read_bytes() == b"gpch built by another process before this one"
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) == {GCH: b"gpch kept"}  # what was built before this process loaded Kiln is not stored
    os.remove(folder / GCH)
    headers.restore(store(tmp_path))  # once a process for a cache
    assert not (folder / GCH).exists()


def test_a_header_built_before_the_first_look_by_a_compile_without_the_cache_is_kept(tmp_path, folder, monkeypatch):
    """The process's first CPU compile did not use Kiln's cache (an uncached Kiln compile, torch.compile)
    and built the header; its first lowering with the cache stores it, and a later process whose folder
    was cleared gets it back."""
    build(folder, GCH)  # after the process loaded Kiln (said outright: a file's time can lag the clock a tick)
    os.utime(folder / GCH, ns=(headers._loaded_ns + 10**9, headers._loaded_ns + 10**9))
    headers.restore(store(tmp_path))
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) == {GCH: DONE}
    new_process(monkeypatch)
    clear(folder)
    headers.restore(store(tmp_path))
    assert os.listdir(folder) == [GCH]


def test_each_cache_a_process_uses_writes_its_headers_back(tmp_path, folder, monkeypatch):
    one, two = CacheOptions(dir=str(tmp_path / "one")).open(), CacheOptions(dir=str(tmp_path / "two")).open()
    headers.restore(one)
    build(folder, "cone.h.gch", b"gpch one's")
    headers.keep_new(one)
    new_process(monkeypatch)
    headers.restore(two)
    build(folder, "ctwo.h.gch", b"gpch two's")
    headers.keep_new(two)
    new_process(monkeypatch)
    clear(folder)
    headers.restore(one)
    headers.restore(two)  # a second model of the server, with a cache of its own
    assert sorted(os.listdir(folder)) == ["cone.h.gch", "ctwo.h.gch"]
    ask(folder, "cone.h.gch")
    ask(folder, "ctwo.h.gch")
    build(folder, "cnew.h.gch", b"gpch new")
    headers.keep_new(one)
    stored = one.read(entry_key(headers.header_fields())).files
    assert stored == {"cone.h.gch": b"gpch one's", "cnew.h.gch": b"gpch new"}  # two's written-back one not taken


def test_a_header_still_being_written_waits_for_the_next_look(tmp_path, folder):
    headers.restore(store(tmp_path))
    build(folder, GCH, b"gpcWrite half of a header")  # gcc marks it finished last
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) is None
    build(folder, GCH)
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) == {GCH: DONE}


@pytest.mark.skipif(os.name != "posix", reason="links and pipes")
def test_a_link_or_a_pipe_named_as_a_header_is_not_read(tmp_path, folder):
    headers.restore(store(tmp_path))
    secret = tmp_path / "secret"
    secret.write_bytes(b"gpch not a header")
    os.makedirs(folder, exist_ok=True)
    os.symlink(secret, folder / "clink.h.gch")
    os.mkfifo(folder / "cpipe.h.gch")
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) is None


@pytest.mark.parametrize("name", ["sub/inner.h.gch", "kernel.so", "cabc.h", ".h.gch", "c" * 200 + ".h.gch",
                                  "x.h.gch\n", "../escape.h.gch"])
def test_a_signed_entry_with_a_name_that_is_not_a_headers_writes_nothing(tmp_path, folder, name, caplog):
    from kiln.compiler.cache import trust
    from kiln.compiler.cache.entry import encode

    signed = store(tmp_path)  # signed as Kiln would, though Kiln's own write refuses a name outside the folder
    data = encode(Entry(key=entry_key(headers.header_fields()), fields=headers.header_fields(),
                        files={GCH: b"fine", name: b"payload"}, created=1.0))
    open(signed.path(entry_key(headers.header_fields())), "wb").write(data + trust.sign(signed._key, data))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        headers.restore(store(tmp_path))
    if name.startswith(".."):  # refused by the entry's own checks, before it is read as headers
        assert "names a file outside its directory" in caplog.text
    else:
        said = f"were not written back (the entry's file {name[:80]!r} is not a precompiled header's name)"
        assert said in caplog.text
    assert not folder.exists() and not (tmp_path / "torchinductor_me" / "escape.h.gch").exists()


def test_a_write_back_that_fails_midway_keeps_the_entry_whole(tmp_path, folder, monkeypatch, caplog):
    """The disk fills after the first of two headers is written back: the entry keeps both (the one
    written back is Kiln's own, not a header this process built)."""
    headers.restore(store(tmp_path))
    build(folder, GCH)
    build(folder, "cwrapper.h.gch", b"gpch another header")
    headers.keep_new(store(tmp_path))
    new_process(monkeypatch)
    clear(folder)
    real_link, links = os.link, []

    def link_then_full(source, target):
        if links:
            raise OSError(28, "No space left on device")
        links.append(target)
        real_link(source, target)

    monkeypatch.setattr(headers.os, "link", link_then_full)
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.restore(store(tmp_path))
    assert "were not written back (No space left on device)" in caplog.text and len(os.listdir(folder)) == 1
    ask(folder, os.listdir(folder)[0])
    headers.keep_new(store(tmp_path))
    assert sorted(kept(tmp_path)) == sorted([GCH, "cwrapper.h.gch"])


def test_a_tampered_entry_is_refused_and_removed(tmp_path, folder, monkeypatch, caplog):
    headers.restore(store(tmp_path))
    build(folder, GCH)
    headers.keep_new(store(tmp_path))
    path = store(tmp_path).path(entry_key(headers.header_fields()))
    data = open(path, "rb").read()
    open(path, "wb").write(data.replace(DONE, b"gpch+014 a planted header..."[:len(DONE)]))
    new_process(monkeypatch)
    clear(folder)
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.restore(store(tmp_path))
    assert "refused" in caplog.text and "none kept" in caplog.text
    assert not (folder / GCH).exists() and not os.path.exists(path)


@pytest.mark.skipif(os.name != "posix", reason="owners and modes are POSIX's")
def test_a_folder_others_can_write_is_neither_written_nor_read(tmp_path, folder, monkeypatch, caplog):
    kept_then_gone(tmp_path, folder, monkeypatch)
    os.chmod(folder, 0o777)
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.restore(store(tmp_path))
        build(folder, "cplanted.h.gch", b"gpch someone else's")
        headers.keep_new(store(tmp_path))
    assert not (folder / GCH).exists() and "can be written by other users (mode 0777" in caplog.text
    assert kept(tmp_path) == {GCH: DONE}  # the planted file was not signed as the user's


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
@pytest.mark.parametrize("linked", ["folder", "parent"])
def test_a_folder_that_is_a_link_is_left_alone(tmp_path, folder, monkeypatch, caplog, linked):
    kept_then_gone(tmp_path, folder, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    if linked == "folder":
        elsewhere.mkdir()
        os.rmdir(folder)
        os.symlink(elsewhere, folder)
    else:
        os.rename(folder.parent, elsewhere)
        os.symlink(elsewhere, folder.parent)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        headers.restore(store(tmp_path))
    assert "is a symbolic link or not a folder" in caplog.text
    assert [name for _, _, names in os.walk(elsewhere) for name in names] == []


def test_a_header_that_appears_while_kiln_writes_is_left_as_it_is(tmp_path, folder, monkeypatch):
    kept_then_gone(tmp_path, folder, monkeypatch)
    real = os.path.lexists

    def appears(path):  # after Kiln looked, before it writes: another process built it
        if str(path).endswith(GCH) and not real(path):
            (folder / GCH).write_bytes(b"gpch built meanwhile")
            return False
        return real(path)

    monkeypatch.setattr(headers.os.path, "lexists", appears)
    headers.restore(store(tmp_path))
    monkeypatch.undo()
    assert (folder / GCH).read_bytes() == b"gpch built meanwhile" and os.listdir(folder) == [GCH]


def test_refresh_writes_nothing_back(tmp_path, folder, monkeypatch):
    kept_then_gone(tmp_path, folder, monkeypatch)
    headers.restore(store(tmp_path), use_stored=False)
    assert not (folder / GCH).exists()


def test_a_cache_that_cannot_be_written_still_compiles(tmp_path, folder, monkeypatch, caplog):
    headers.restore(store(tmp_path))
    build(folder, GCH)
    full = store(tmp_path)
    monkeypatch.setattr(full, "write", lambda entry: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.keep_new(full)
    assert "were not stored (No space left on device)" in caplog.text


def test_a_header_that_could_not_be_stored_is_not_read_again_at_every_lowering(tmp_path, folder, monkeypatch):
    headers.restore(store(tmp_path))
    build(folder, GCH)
    reads = []
    monkeypatch.setattr(headers, "_read", lambda path, limit: reads.append(path) or (_ for _ in ()).throw(
        OSError(28, "No space left on device")))
    for _ in range(3):
        headers.keep_new(store(tmp_path))
    assert len(reads) == 1 and kept(tmp_path) is None


@pytest.mark.skipif(os.name != "posix", reason="owners and modes are POSIX's")
def test_a_folder_made_under_a_permissive_umask_is_refused_once_with_what_to_do(tmp_path, folder, monkeypatch, caplog):
    kept_then_gone(tmp_path, folder, monkeypatch)
    os.chmod(folder.parent, 0o775)  # as Inductor makes it where the umask is 002
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.restore(store(tmp_path))
        build(folder, "cnew.h.gch", b"gpch new")
        headers.keep_new(store(tmp_path))
        headers.keep_new(store(tmp_path))
    assert caplog.text.count("are not kept") == 1 and f"chmod go-w {folder.parent}" in caplog.text
    assert not (folder / GCH).exists() and kept(tmp_path) == {GCH: DONE}


def test_a_graph_cache_in_refresh_mode_writes_nothing_back(tmp_path, folder, monkeypatch):
    kept_then_gone(tmp_path, folder, monkeypatch)
    monkeypatch.setattr(cpu_probe, "detect_cpu_vector_isa", lambda store, use_stored: None)  # not this test's

    def lowering():
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        os.makedirs(os.path.join(cache_dir(), "fxgraph"), exist_ok=True)
        open(os.path.join(cache_dir(), "fxgraph", "entry"), "w").write("compiled")
        return (lambda x: x), "inductor"

    fields = {"graph": "g1", "inputs": "i1", "options": "{}", "torch": "2.13", "label": "Tiny graph 0",
              "device": "cpu (x86_64)"}
    GraphCache(CacheOptions(dir=str(tmp_path / "cache"), mode="refresh")).lower(lowering, fields)
    assert not (folder / GCH).exists()


def test_an_unexpected_failure_is_said_and_the_lowering_goes_on(tmp_path, folder, monkeypatch, caplog):
    headers.restore(store(tmp_path))
    build(folder, GCH)
    monkeypatch.setattr(headers, "_read", lambda path, limit: (_ for _ in ()).throw(MemoryError("out of memory")))
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.keep_new(store(tmp_path))
    assert "were not stored (MemoryError: out of memory)" in caplog.text


def test_headers_too_large_for_the_caches_size_cap_are_not_stored(tmp_path, folder, caplog):
    small = CacheOptions(dir=str(tmp_path / "cache"), max_gb=1000 / 2**30).open()  # 1000 bytes
    small.write(Entry(key="a" * 32, fields={"graph": "g"}, files={"fxgraph/x": b"compiled"}))
    headers.restore(small)
    build(folder, GCH, b"gpch" + b"x" * 300)
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.keep_new(small)
        headers.keep_new(small)
    assert caplog.text.count("are not stored: more than 25% of the cache's size cap") == 1
    assert kept(tmp_path) is None and small.read("a" * 32) is not None  # the compiled graph stays


def test_without_precompiled_headers_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "inductor_header_dir", lambda: None)
    new_process(monkeypatch)
    headers.restore(store(tmp_path))
    headers.keep_new(store(tmp_path))
    assert kept(tmp_path) is None


def test_inductors_folder_is_in_the_temporary_folder_not_its_cache_dir(tmp_path):
    """Where a reboot clears it, and where Kiln's lowering, pointed at a folder of its own, does not move it."""
    if compat.inductor_header_dir() is None:
        pytest.skip("this torch precompiles no headers")
    env = dict(os.environ, TMPDIR=str(tmp_path / "temp"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    os.makedirs(tmp_path / "temp")
    where = "from kiln.compiler import compat; print(compat.inductor_header_dir())"
    done = subprocess.run([sys.executable, "-c", where], env=env, capture_output=True, text=True, check=True)
    path = done.stdout.strip().splitlines()[-1]
    assert path.startswith(str(tmp_path / "temp")) and os.path.basename(path) == "precompiled_headers"


def test_a_cpu_lowering_writes_the_headers_back_before_it_runs_and_keeps_those_it_built(tmp_path, folder,
                                                                                         monkeypatch):
    monkeypatch.setattr(cpu_probe, "detect_cpu_vector_isa", lambda store, use_stored: None)  # not this test's
    seen = []

    def lowering():
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        seen.append(sorted(os.listdir(folder)) if folder.exists() else [])
        if not (folder / GCH).exists():
            build(folder, GCH)  # Inductor builds the header it lacks
        path = os.path.join(cache_dir(), "fxgraph", "entry")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write("compiled")
        return (lambda x: x), "inductor"

    fields = {"graph": "g1", "inputs": "i1", "options": "{}", "torch": "2.13", "label": "Tiny graph 0",
              "device": "cpu (x86_64)"}
    GraphCache(CacheOptions(dir=str(tmp_path / "cache"))).lower(lowering, dict(fields))
    assert kept(tmp_path) == {GCH: DONE}
    new_process(monkeypatch)
    clear(folder)
    GraphCache(CacheOptions(dir=str(tmp_path / "cache"))).lower(lowering, dict(fields, graph="g2"))
    assert seen == [[], [GCH]]  # written back before the second lowering ran
    before = (sorted(os.listdir(folder)), kept(tmp_path))
    build(folder, "cnew.h.gch", b"gpch built by no CPU lowering")
    GraphCache(CacheOptions(dir=str(tmp_path / "cache"))).lower(lowering, dict(fields, graph="g3", device="cuda"))
    assert len(seen) == 3 and kept(tmp_path) == before[1]  # a CUDA lowering neither writes back nor stores


def test_the_header_built_ahead_of_a_cpu_lowering_starts_after_the_cache_wrote_its_headers_back(tmp_path, folder,
                                                                                                 monkeypatch):
    """Kiln has Inductor's header built in a thread beside the first CPU lowering (lowering.build_cpu_header_ahead):
    with a cache, only once the cache has written back the headers it keeps, so the build finds them there."""
    import torch

    from kiln import CompileOptions
    from kiln.compiler.backend import lowering

    order = []
    restore = headers.restore
    monkeypatch.setattr(cpu_probe, "detect_cpu_vector_isa", lambda store, use_stored: None)  # not this test's
    monkeypatch.setattr(headers, "restore", lambda store, use_stored=True: order.append("restore") or restore(store, use_stored))
    monkeypatch.setattr(lowering, "_header_asked", False)
    monkeypatch.setattr(lowering, "_header_thread", None)
    monkeypatch.setattr(compat, "cpu_vector_isa_detected", lambda: True)
    monkeypatch.setattr(compat, "cpu_kernel_header_build", lambda: (lambda: order.append("ahead"), ""))
    monkeypatch.setattr(compat, "inductor_backend", lambda device: lambda gm, args: gm.forward)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)

    def lower():
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        compiled = lowering.LOWERINGS["balanced"].lower(gm, [torch.ones(2)], CompileOptions(), "cpu")
        os.makedirs(os.path.join(cache_dir(), "fxgraph"), exist_ok=True)
        open(os.path.join(cache_dir(), "fxgraph", "entry"), "w").write("compiled")
        return compiled

    fields = {"graph": "g1", "inputs": "i1", "options": "{}", "torch": "2.13", "label": "Tiny graph 0",
              "device": "cpu (x86_64)"}
    GraphCache(CacheOptions(dir=str(tmp_path / "cache"))).lower(lower, fields)
    lowering._header_thread.join(timeout=10)
    assert order == ["restore", "ahead"]


def test_headers_past_the_limit_of_an_entry_of_them_are_not_stored(tmp_path, folder, monkeypatch, caplog):
    from kiln.compiler.cache import entry as entry_module

    monkeypatch.setattr(entry_module, "MAX_HEADERS_ENTRY_BYTES", entry_module.MAX_HEADER_BYTES + 100)
    headers.restore(store(tmp_path))
    build(folder, GCH, b"gpch" + b"x" * 300)
    with caplog.at_level(logging.INFO, logger="kiln"):
        headers.keep_new(store(tmp_path))
    assert "are not stored: more than an entry of them may hold" in caplog.text and kept(tmp_path) is None
