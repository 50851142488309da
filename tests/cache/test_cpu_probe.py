"""Inductor's CPU instruction-set probe under Kiln's cache: its test programs are built once, kept as a
signed entry and written back for a later process, which then builds none; a bad entry or a cache that
cannot be written never stops the probe."""
import logging
import os
import subprocess
import sys

import pytest

from kiln.compiler import compat
from kiln.compiler.cache import CacheOptions, CacheStore, GraphCache, cpu_probe, entry_key

FIELDS = {"graph": "g1", "inputs": "i1", "options": "{}", "torch": "2.13", "label": "Tiny graph 0"}


def fake_lowering():
    """Writes an Inductor-like graph record into Inductor's current cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = os.path.join(cache_dir(), "fxgraph", "entry")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").write("compiled")
    return (lambda x: x), "inductor"


class FakeProbe:
    """Like Inductor's probe: builds each test program into its current cache directory unless it is
    there already, once a process (`new_process()` forgets the answer)."""

    PROGRAMS = ("ab/cavx512.cpp", "ab/cavx512.so", "cd/cavx2.cpp", "cd/cavx2.so")

    def __init__(self, monkeypatch, programs=PROGRAMS, child_exit=0, gate=None, child_answer="avx2 avx512"):
        self.programs, self.builds, self.dirs, self.done, self.children = programs, 0, [], False, []
        self.child_exit, self.gate, self.monkeypatch, self.started = child_exit, gate, monkeypatch, []
        self.child_answer = child_answer
        monkeypatch.setattr(compat, "cpu_vector_isa_answer", lambda: "avx2 avx512")
        monkeypatch.setattr(compat, "detect_cpu_vector_isa", self)
        monkeypatch.setattr(compat, "start_cpu_probe_child", self.start_child)
        monkeypatch.setattr(compat, "cpu_vector_isa_detected", lambda: self.done)
        self.new_process()

    def __call__(self):
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        self.dirs.append(cache_dir())
        for name in self.programs:
            path = os.path.join(cache_dir(), *name.split("/"))
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "wb").write(b"program " + name.encode())
                self.builds += 1
        self.done = True

    def start_child(self, cache_dir):
        """The probe in a child process: the programs into `cache_dir`; this process's answer unchanged."""
        self.children.append(cache_dir)
        code = ("import os, sys, time\n"
                f"gate, end = {str(self.gate) if self.gate else ''!r}, time.time() + 30\n"
                "while gate and not os.path.exists(gate) and time.time() < end:\n"
                "    time.sleep(0.05)\n"
                "for name in sys.argv[2:]:\n"
                "    path = os.path.join(sys.argv[1], *name.split('/'))\n"
                "    os.makedirs(os.path.dirname(path), exist_ok=True)\n"
                "    open(path, 'wb').write(b'program ' + name.encode())\n"
                f"print({self.child_answer!r})\n"
                f"sys.exit({self.child_exit})\n")
        child = subprocess.Popen([sys.executable, "-c", code, cache_dir, *self.programs], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.started.append(child)
        return child

    def new_process(self):
        self.done = False
        self.monkeypatch.setattr(cpu_probe, "_looked", set())
        self.monkeypatch.setattr(cpu_probe, "_programs", {})
        self.monkeypatch.setattr(cpu_probe, "_building", [])
        self.monkeypatch.setattr(cpu_probe, "_exiting", False)
        self.monkeypatch.setattr(compat, "cpu_probe_builds_programs", lambda: True)

    def probed_without_kiln(self, where):
        """As a first CPU compile that did not use Kiln's cache: the probe ran in Inductor's own folder."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        with temporary_cache_dir(str(where)):
            self()


def _store(tmp_path) -> CacheStore:
    return CacheOptions(dir=str(tmp_path)).open()


def test_the_programs_are_built_once_and_a_later_process_builds_none(tmp_path, monkeypatch, caplog):
    probe = FakeProbe(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert probe.builds == 4 and "stored its test programs in Kiln's cache (built in" in caplog.text
    assert probe.dirs[0].startswith(os.path.join(os.path.realpath(tmp_path), "work"))  # Kiln's folder, not Inductor's
    entry = _store(tmp_path).read(entry_key(cpu_probe.probe_fields()))
    assert sorted(entry.files) == sorted(FakeProbe.PROGRAMS)

    probe.new_process()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert probe.builds == 4 and probe.done and "loaded its test programs from Kiln's cache" in caplog.text


def test_whether_the_probe_would_build_its_programs_here(tmp_path, monkeypatch):
    """What decides whether the probe may run beside a capture (GraphCache.ready_cpu_files_ahead)."""
    probe = FakeProbe(monkeypatch)
    assert cpu_probe.builds_programs(_store(tmp_path))  # not probed, nothing stored
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert not cpu_probe.builds_programs(_store(tmp_path))  # probed in this process
    probe.new_process()
    assert not cpu_probe.builds_programs(_store(tmp_path))  # a later process: the programs are stored
    assert cpu_probe.builds_programs(_store(tmp_path), use_stored=False)  # refresh: stored ones are not read
    assert cpu_probe.builds_programs(_store(tmp_path / "other"))
    monkeypatch.setattr(compat, "cpu_probe_builds_programs", lambda: False)  # Inductor decides without programs
    assert not cpu_probe.builds_programs(_store(tmp_path / "other"))


def _entry_files(tmp_path):
    entry = _store(tmp_path).read(entry_key(cpu_probe.probe_fields()))
    return None if entry is None else sorted(entry.files)


def test_once_a_process_and_a_second_cache_gets_the_same_programs_without_a_build(tmp_path, monkeypatch):
    probe = FakeProbe(monkeypatch)
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert len(probe.dirs) == 1
    other = tmp_path / "other"
    cpu_probe.detect_cpu_vector_isa(_store(other))  # a second model of the server, with a cache of its own
    assert len(probe.dirs) == 1 and _entry_files(other) == sorted(FakeProbe.PROGRAMS)


def finish_background():
    for thread in cpu_probe._building:
        thread.join(60)
        assert not thread.is_alive()


def test_a_process_that_probed_before_it_used_the_cache_has_the_programs_built_in_the_background(
        tmp_path, monkeypatch, caplog):
    """Its first CPU compile was uncached (or torch.compile's): the probe ran in Inductor's folder. The
    first cache it uses that lacks the entry gets the programs, built by a child process in Kiln's
    folder while the compile goes on (one build at a time); another cache gets the same files, and the
    next process builds none."""
    probe = FakeProbe(monkeypatch, gate=tmp_path / "go")
    probe.probed_without_kiln(tmp_path / "inductor")
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "cache"))
        assert "being built in the background for the next start" in caplog.text
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "other"))  # meanwhile: no second build
        assert len(probe.children) == 1 and _entry_files(tmp_path / "other") is None
        (tmp_path / "go").touch()
        finish_background()
    assert "stored its test programs in Kiln's cache (built in" in caplog.text
    assert len(probe.children) == 1 and probe.children[0].startswith(os.path.realpath(tmp_path / "cache" / "work"))
    assert _entry_files(tmp_path / "cache") == sorted(FakeProbe.PROGRAMS)
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "cache"))
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "other"))
    assert len(probe.children) == 1 and _entry_files(tmp_path / "other") == sorted(FakeProbe.PROGRAMS)

    probe.new_process()
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "cache"))
    assert probe.builds == 4 and probe.done  # only the first process's own probe built any


@pytest.mark.parametrize("child, said", [
    ({"child_exit": 3}, "the background build failed (exit 3"),
    # a child starved past Inductor's limit on loading a program finds fewer sets, and built fewer
    ({"child_answer": "avx2"}, "found 'avx2' where this process found 'avx2 avx512'"),
    ({"child_answer": "avx512"}, "found 'avx512' where this process found 'avx2 avx512'"),
])
def test_a_background_build_that_fails_or_answers_otherwise_stores_nothing_and_says_why(
        tmp_path, monkeypatch, caplog, child, said):
    probe = FakeProbe(monkeypatch, **child)
    probe.probed_without_kiln(tmp_path / "inductor")
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
        finish_background()
    assert said in caplog.text and _entry_files(tmp_path) is None


def test_a_background_build_that_finds_more_sets_than_this_process_is_stored(tmp_path, monkeypatch):
    """This process's own probe was the one starved: the child's programs cover every set it uses."""
    probe = FakeProbe(monkeypatch, child_answer="amx avx2 avx512")
    probe.probed_without_kiln(tmp_path / "inductor")
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    finish_background()
    assert _entry_files(tmp_path) == sorted(FakeProbe.PROGRAMS)


def test_a_background_build_that_breaks_while_storing_says_why(tmp_path, monkeypatch, caplog):
    """Any error in the background thread is said in the log with its type and message, nothing more."""
    probe = FakeProbe(monkeypatch)
    probe.probed_without_kiln(tmp_path / "inductor")

    def unreadable(folder):
        raise ValueError("a program vanished while it was read")

    monkeypatch.setattr(cpu_probe, "read_files", unreadable)
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
        finish_background()
    assert "not stored (ValueError: a program vanished while it was read)" in caplog.text
    assert _entry_files(tmp_path) is None


def test_a_background_build_that_cannot_start_or_takes_too_long_stores_nothing(tmp_path, monkeypatch, caplog):
    probe = FakeProbe(monkeypatch)
    probe.probed_without_kiln(tmp_path / "inductor")
    monkeypatch.setattr(compat, "start_cpu_probe_child", lambda cache_dir: (_ for _ in ()).throw(
        OSError("this Python does not know its own program (sys.executable is empty)")))
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "one"))
    assert "cannot be built for it (this Python does not know its own program" in caplog.text

    monkeypatch.setattr(compat, "start_cpu_probe_child", lambda cache_dir: subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], stderr=subprocess.PIPE, text=True,
        start_new_session=True))
    monkeypatch.setattr(cpu_probe, "CHILD_SECONDS", 0.5)
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path / "two"))
        finish_background()
    assert "took more than 0.5s and was stopped; nothing stored" in caplog.text
    assert _entry_files(tmp_path / "one") is None and _entry_files(tmp_path / "two") is None


def test_a_process_that_probed_before_finds_the_entry_and_builds_nothing(tmp_path, monkeypatch):
    probe = FakeProbe(monkeypatch)
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    probe.new_process()
    probe.probed_without_kiln(tmp_path / "inductor")
    writes = []
    monkeypatch.setattr(CacheStore, "write", lambda self, entry: writes.append(entry))
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert (probe.builds, probe.children, writes) == (8, [], [])


def test_where_inductor_builds_no_programs_a_process_that_probed_before_starts_no_build(tmp_path, monkeypatch):
    probe = FakeProbe(monkeypatch)
    monkeypatch.setattr(compat, "cpu_probe_builds_programs", lambda: False)  # cpp.vec_isa_ok set, or not x86
    probe.probed_without_kiln(tmp_path / "inductor")
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert probe.children == [] and _entry_files(tmp_path) is None


def test_a_background_build_that_makes_no_programs_stores_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    probe = FakeProbe(monkeypatch, programs=())
    probe.probed_without_kiln(tmp_path / "inductor")
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
        finish_background()
    assert _entry_files(tmp_path) is None and "made no test programs here; nothing to keep" in caplog.text


def test_a_build_running_when_the_process_exits_is_stopped_quietly(tmp_path, monkeypatch, caplog):
    probe = FakeProbe(monkeypatch, gate=tmp_path / "never")
    probe.probed_without_kiln(tmp_path / "inductor")
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
        cpu_probe._stop(probe.started[0])  # what atexit runs
        finish_background()
    assert probe.started[0].returncode is not None and _entry_files(tmp_path) is None
    assert "failed" not in caplog.text and "not stored" not in caplog.text


def test_a_build_whose_thread_cannot_start_stops_its_child_and_the_compile_goes_on(tmp_path, monkeypatch, caplog):
    import threading

    probe = FakeProbe(monkeypatch, gate=tmp_path / "never")
    probe.probed_without_kiln(tmp_path / "inductor")
    monkeypatch.setattr(threading.Thread, "start", lambda self: (_ for _ in ()).throw(
        RuntimeError("can't start new thread")))
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert "cannot be built for it (RuntimeError: can't start new thread)" in caplog.text
    assert probe.started[0].returncode is not None and cpu_probe._building == []


def test_the_entry_is_keyed_by_the_machine_torch_and_python_not_by_kiln(monkeypatch):
    from kiln.compiler.cache import key

    before = cpu_probe.probe_fields()
    assert {"device", "torch", "python"} <= set(before) and "kiln" not in before
    monkeypatch.setattr(key, "source_hash", lambda: "another Kiln")
    assert cpu_probe.probe_fields() == before
    monkeypatch.setattr(key.torch, "__version__", "9.9.9")
    assert entry_key(cpu_probe.probe_fields()) != entry_key(before)


def test_programs_the_entry_lacks_are_built_and_the_entry_replaced(tmp_path, monkeypatch):
    FakeProbe(monkeypatch, programs=FakeProbe.PROGRAMS[:2])
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    probe = FakeProbe(monkeypatch)  # another compiler: Inductor's names differ for some programs
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert probe.builds == 2
    entry = _store(tmp_path).read(entry_key(cpu_probe.probe_fields()))
    assert sorted(entry.files) == sorted(FakeProbe.PROGRAMS)


def test_a_tampered_entry_is_refused_and_the_probe_builds_afresh(tmp_path, monkeypatch, caplog):
    probe = FakeProbe(monkeypatch)
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    path = _store(tmp_path).path(entry_key(cpu_probe.probe_fields()))
    data = open(path, "rb").read()
    open(path, "wb").write(data.replace(b"program ab/cavx512.so", b"payload ab/cavx512.so"))
    probe.new_process()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    assert "refused" in caplog.text and probe.builds == 8  # nothing of the tampered entry was written back
    assert _store(tmp_path).read(entry_key(cpu_probe.probe_fields())) is not None  # stored afresh


def test_a_tampered_entry_is_refused_in_a_process_that_probed_before_and_built_afresh(tmp_path, monkeypatch, caplog):
    """Nothing of a changed entry is written anywhere: it is refused and removed, and the background
    build stores the programs Inductor's own probe makes."""
    probe = FakeProbe(monkeypatch)
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    path = _store(tmp_path).path(entry_key(cpu_probe.probe_fields()))
    open(path, "wb").write(open(path, "rb").read().replace(b"program ab/cavx512.so", b"payload ab/cavx512.so"))
    probe.new_process()
    probe.probed_without_kiln(tmp_path / "inductor")
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
        finish_background()
    assert "refused" in caplog.text and len(probe.children) == 1
    entry = _store(tmp_path).read(entry_key(cpu_probe.probe_fields()))
    assert entry.files["ab/cavx512.so"] == b"program ab/cavx512.so"


def test_a_cache_that_cannot_be_written_still_probes(tmp_path, monkeypatch, caplog):
    probe = FakeProbe(monkeypatch)
    store = _store(tmp_path)
    monkeypatch.setattr(store, "write", lambda entry: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    with caplog.at_level(logging.INFO, logger="kiln"):
        cpu_probe.detect_cpu_vector_isa(store)
    assert probe.done and probe.builds == 4 and "were not stored (Read-only file system)" in caplog.text


def test_a_cache_whose_work_folder_cannot_be_made_still_probes(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # where Inductor probes without Kiln
    probe = FakeProbe(monkeypatch)
    store = _store(tmp_path)
    monkeypatch.setattr(store, "work_dir", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    cpu_probe.detect_cpu_vector_isa(store)
    assert probe.done and probe.builds == 4 and probe.dirs == [str(tmp_path / "inductor")]


def test_a_cpu_lowering_probes_first_in_kilns_folder_and_a_cuda_one_never(tmp_path, monkeypatch):
    probe = FakeProbe(monkeypatch)
    cache = GraphCache(CacheOptions(dir=str(tmp_path)))
    cache.lower(fake_lowering, dict(FIELDS, graph="g2", device="cuda sm_90 (H100)"))
    assert probe.dirs == []
    cache.lower(fake_lowering, dict(FIELDS, device="cpu (x86_64)"))
    assert len(probe.dirs) == 1 and probe.done


def test_refresh_probes_afresh_and_replaces_the_entry(tmp_path, monkeypatch):
    probe = FakeProbe(monkeypatch)
    cpu_probe.detect_cpu_vector_isa(_store(tmp_path))
    probe.new_process()
    GraphCache(CacheOptions(dir=str(tmp_path), mode="refresh")).lower(fake_lowering, dict(FIELDS, device="cpu (x86_64)"))
    assert probe.builds == 8  # nothing stored was written back


CHILD = """
import sys
from torch._inductor import cpp_builder, cpu_vec_isa
from kiln.compiler.cache import CacheOptions, cpu_probe
builds = []
real_build = cpp_builder.CppBuilder.build
cpp_builder.CppBuilder.build = lambda self: builds.append(1) or real_build(self)
cpu_probe.detect_cpu_vector_isa(CacheOptions(dir=sys.argv[1]).open())
print(len(builds), len(cpu_vec_isa.valid_vec_isa_list()))
"""


@pytest.mark.slow
def test_inductors_own_probe_in_a_later_process_builds_nothing(tmp_path):
    """The real probe (about 8 s on a 2-core CPU), in two processes each with an empty Inductor cache
    directory: the second takes the programs from Kiln's cache and runs no compiler."""
    runs = []
    for process in ("first", "second"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{process}"))
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "kiln")], env=env, capture_output=True,
                              text=True, check=True)
        runs.append(tuple(int(n) for n in done.stdout.split()[-2:]))
    (first_builds, sets), (second_builds, sets_again) = runs
    assert first_builds >= 1 and second_builds == 0 and sets == sets_again


@pytest.mark.parametrize("hostile", ["tampered", "a link to another file", "larger than the cache"])
def test_a_hostile_probe_entry_read_beside_the_capture_is_refused_and_the_compile_goes_on(
        tmp_path, monkeypatch, caplog, hostile):
    """The thread that makes Inductor's CPU files ready beside the first capture reads the cache's entry
    as the first lowering did: one that is not Kiln's is refused, said, never written back or followed,
    never read whole past the cache's size cap, and the probe builds its programs afresh."""
    from kiln.compiler.cache import headers

    probe = FakeProbe(monkeypatch)
    monkeypatch.setattr(headers, "restore", lambda store, use_stored=True: None)  # the probe's entry only
    options = CacheOptions(dir=str(tmp_path / "cache"), max_gb=0.001)
    cpu_probe.detect_cpu_vector_isa(options.open())
    path = options.open().path(entry_key(cpu_probe.probe_fields()))
    secret = tmp_path / "secret"
    secret.write_bytes(b"the user's own file")
    if hostile == "tampered":
        data = open(path, "rb").read()
        open(path, "wb").write(data.replace(b"program ab/cavx512.so", b"payload ab/cavx512.so"))
    elif hostile == "a link to another file":
        os.remove(path)
        os.symlink(secret, path)
    else:
        with open(path, "r+b") as f:
            f.truncate(options.open().max_bytes + 1)
    probe.new_process()
    cache = GraphCache(options)
    with caplog.at_level(logging.INFO, logger="kiln"):
        cache.ready_cpu_files_ahead()
        assert cache._ahead is not None  # a file is there: the thread reads it
        cache.finish_ahead()
        _, _, event = cache.lower(fake_lowering, dict(FIELDS, device="cpu"))
    assert "Kiln: refused" in caplog.text and event.outcome == "miss"
    assert probe.builds == 8  # built afresh: nothing of the hostile entry was written back
    assert secret.read_bytes() == b"the user's own file" and os.path.isfile(path) and not os.path.islink(path)
    assert _store(tmp_path / "cache").read(entry_key(cpu_probe.probe_fields())) is not None  # Kiln's own again
