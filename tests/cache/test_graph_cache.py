"""GraphCache around a lowering, with a stand-in lowering that writes Inductor-like files (no compile):
hit, miss, refresh, refused entries, and a cache that cannot be used or written."""
import errno
import json
import logging
import os

import pytest

from kiln.compiler.cache import CacheOptions, CacheStore, Entry, GraphCache, entry_key
from kiln.compiler.cache import entry as entry_module
from kiln.compiler.cache import store as store_module


class FakeLowering:
    """Writes an 'fxgraph' file into Inductor's current cache directory, like a cold lowering; counts
    an Inductor cache hit when it finds one there, like a warm one."""

    def __init__(self):
        self.compiles = 0

    def __call__(self):
        from torch._dynamo.utils import counters
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        if os.sep + "work" + os.sep not in cache_dir():  # not under Kiln's cache: leave Inductor's own dir alone
            self.compiles += 1
            return (lambda x: x), "inductor"
        path = os.path.join(cache_dir(), "fxgraph", "entry")
        if os.path.exists(path):
            counters["inductor"]["fxgraph_cache_hit"] += 1
        else:
            self.compiles += 1
            counters["inductor"]["fxgraph_cache_miss"] += 1
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").write("compiled")
        return (lambda x: x), "inductor"


FIELDS = {"graph": "g1", "inputs": "i1", "options": "{}", "torch": "2.13", "label": "Tiny graph 0"}


def test_miss_stores_then_a_new_model_hits(tmp_path):
    options = CacheOptions(dir=str(tmp_path))
    lowering = FakeLowering()
    _, _, first = GraphCache(options).lower(lowering, dict(FIELDS))
    assert first.outcome == "miss" and "no entry for this graph yet" in first.reason and first.entry_bytes > 0
    _, name, second = GraphCache(options).lower(lowering, dict(FIELDS))
    assert second.outcome == "hit" and lowering.compiles == 1 and name == "inductor"
    assert "saved" in second.line()


def test_a_changed_field_misses_naming_it(tmp_path):
    options = CacheOptions(dir=str(tmp_path))
    GraphCache(options).lower(FakeLowering(), dict(FIELDS))
    _, _, event = GraphCache(options).lower(FakeLowering(), dict(FIELDS, torch="2.14"))
    assert event.outcome == "miss" and "torch: 2.13 -> 2.14" in event.reason


def test_refresh_compiles_and_replaces(tmp_path):
    GraphCache(CacheOptions(dir=str(tmp_path))).lower(FakeLowering(), dict(FIELDS))
    lowering = FakeLowering()
    _, _, event = GraphCache(CacheOptions(dir=str(tmp_path), mode="refresh")).lower(lowering, dict(FIELDS))
    assert event.outcome == "refresh" and lowering.compiles == 1


def test_off_neither_reads_nor_writes(tmp_path):
    _, _, event = GraphCache(CacheOptions(dir=str(tmp_path / "c"), mode="off")).lower(FakeLowering(), dict(FIELDS))
    assert event.outcome == "off" and not (tmp_path / "c").exists()


def test_a_corrupt_entry_is_refused_reported_and_recompiled(tmp_path, caplog):
    options = CacheOptions(dir=str(tmp_path))
    GraphCache(options).lower(FakeLowering(), dict(FIELDS))
    path = os.path.join(str(tmp_path), "entries", entry_key(FIELDS) + ".kiln")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-40] + b"x" * 40)
    lowering = FakeLowering()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "miss" and "refused" in event.reason and "signature" in event.reason
    assert lowering.compiles == 1 and "refused" in caplog.text
    _, _, again = GraphCache(options).lower(FakeLowering(), dict(FIELDS))
    assert again.outcome == "hit"  # the fresh compile replaced it


def test_an_entry_inductor_does_not_find_is_replaced(tmp_path):
    options = CacheOptions(dir=str(tmp_path))
    store = CacheStore(str(tmp_path), options.max_bytes)
    store.write(Entry(key=entry_key(FIELDS), fields=dict(FIELDS), files={"fxgraph/other": b"x"}))
    lowering = FakeLowering()
    _, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "miss" and "Inductor compiled anyway" in event.reason and lowering.compiles == 1


def test_a_directory_that_cannot_be_made_degrades_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = GraphCache(CacheOptions(dir=str(blocker / "cache")))
    lowering = FakeLowering()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        for _ in range(3):
            compiled, _, event = cache.lower(lowering, dict(FIELDS))
    assert event.outcome == "unavailable" and "compiling without the cache" in event.reason
    assert lowering.compiles == 3 and compiled(5) == 5
    assert caplog.text.count("compiling without the cache") == 1


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_an_untrusted_directory_degrades_with_the_reason(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    _, _, event = GraphCache(CacheOptions(dir=str(root))).lower(FakeLowering(), dict(FIELDS))
    assert event.outcome == "unavailable" and "other users" in event.reason


def test_a_full_disk_degrades_with_one_warning(tmp_path, monkeypatch, caplog):
    def full(self, entry):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CacheStore, "write", full)
    cache = GraphCache(CacheOptions(dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _, _, first = cache.lower(FakeLowering(), dict(FIELDS))
        _, _, second = cache.lower(FakeLowering(), dict(FIELDS, graph="g2"))
    assert "No space left" in first.reason and second.outcome == "unavailable"
    assert caplog.text.count("No space left") == 1


def test_nothing_is_stored_when_inductor_did_not_cache_the_graph(tmp_path):
    def bypassed():
        return (lambda x: x), "inductor"

    _, _, event = GraphCache(CacheOptions(dir=str(tmp_path))).lower(bypassed, dict(FIELDS))
    assert "nothing stored" in event.reason and event.entry_bytes == 0
    assert list(CacheStore(str(tmp_path), 2**30).headers()) == []


def test_the_cache_dir_cannot_be_inside_kilns_folder():
    import kiln
    from kiln.compiler.cache import CacheOptionsError

    with pytest.raises(CacheOptionsError, match="inside Kiln's own folder"):
        CacheOptions(dir=os.path.join(os.path.dirname(kiln.__file__), "cache"))
    with pytest.raises(CacheOptionsError, match="cache mode 'always'"):
        CacheOptions(mode="always")


def test_the_plan_carries_the_cache_and_says_what_changed(tmp_path):
    import torch

    import kiln
    from kiln.compiler import KilnPlan, OptionsError, build_options

    plan = KilnPlan().with_parts(compile=build_options("balanced").compile, cache=CacheOptions(dir=str(tmp_path)))
    assert plan == KilnPlan().with_parts(cache=CacheOptions(dir=str(tmp_path)), compile=build_options("balanced").compile)
    assert f"with Kiln's cache (use, {tmp_path})" in plan.describe()
    refresh = plan.with_parts(cache=CacheOptions(dir=str(tmp_path), mode="refresh"))
    assert refresh.changes_from(plan) == ['cache.mode: "use" -> "refresh"']
    with pytest.raises(OptionsError, match="needs cache_dir"):
        kiln.compile(torch.nn.Linear(2, 2), cache="refresh")
    model = kiln.compile(torch.nn.Linear(2, 2), mode="fast", cache_dir=str(tmp_path))
    with torch.no_grad():
        model(torch.randn(3, 2))
    assert "mode 'fast' has none" in " ".join(kiln.stats(model).warnings) and kiln.stats(model).cache == []


def test_the_compile_nodes_expert_string_sets_the_cache():
    from kiln.compiler import OptionsError, build_options

    text = "mode: max\ncache: {dir: /tmp/kiln-yaml, max_gb: 5}"
    assert build_options(advanced=text).cache == CacheOptions(dir="/tmp/kiln-yaml", max_gb=5)
    assert build_options(advanced=text).compile.mode == "max"  # the compile options ignore the cache key
    assert build_options(advanced="cache: /tmp/elsewhere").cache.root == "/tmp/elsewhere"
    assert build_options(advanced="passes: {fuse_geglu: off}").cache is None
    with pytest.raises(OptionsError, match="cache: unknown key"):
        build_options(advanced="cache: {size: 3}").cache
    with pytest.raises(OptionsError, match="cache mode 'sometimes'"):
        build_options(advanced="cache: {mode: sometimes}").cache


def test_a_hit_that_cannot_be_unpacked_degrades_with_one_warning(tmp_path, monkeypatch, caplog):
    options = CacheOptions(dir=str(tmp_path))
    GraphCache(options).lower(FakeLowering(), dict(FIELDS))

    def read_only(directory, files):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(store_module, "write_files", read_only)
    monkeypatch.setattr("kiln.compiler.cache.graph_cache.write_files", read_only)
    lowering = FakeLowering()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        compiled, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "unavailable" and "Read-only" in event.reason and lowering.compiles == 1
    assert compiled(3) == 3 and caplog.text.count("Read-only") == 1


@pytest.mark.parametrize("header", [b'{"files": []}', b'{"key": "x", "fields": [], "files": []}', b"[" * 5000])
def test_an_entry_with_a_bad_header_is_compiled_again_never_eager(tmp_path, header):
    """A bad header once raised KeyError out of the cache layer: the model ran eagerly."""
    import struct

    options = CacheOptions(dir=str(tmp_path))
    key = entry_key(FIELDS)
    store = CacheStore(str(tmp_path), options.max_bytes)
    open(store.path(key), "wb").write(entry_module.MAGIC + struct.pack(">Q", len(header)) + header)
    lowering = FakeLowering()
    compiled, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "miss" and "refused" in event.reason and "damaged header" in event.reason
    assert lowering.compiles == 1 and compiled(4) == 4
    assert GraphCache(options).lower(FakeLowering(), dict(FIELDS))[2].outcome == "hit"  # stored afresh


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_a_work_folder_others_can_write_means_no_cache_not_eager(tmp_path):
    options = CacheOptions(dir=str(tmp_path))
    CacheStore(str(tmp_path), options.max_bytes)
    os.makedirs(tmp_path / "work", mode=0o700)
    os.chmod(tmp_path / "work", 0o775)
    lowering = FakeLowering()
    compiled, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "unavailable" and "work can be written by other users" in event.reason
    assert lowering.compiles == 1 and compiled(2) == 2


@pytest.mark.parametrize("max_gb", [float("nan"), float("inf"), -1, 0, True, "20"])
def test_max_gb_must_be_a_positive_finite_number(max_gb):
    from kiln.compiler.cache import CacheOptionsError

    with pytest.raises(CacheOptionsError, match="max_gb"):
        CacheOptions(max_gb=max_gb)


def test_a_directory_outside_the_allowed_ones_is_not_used(tmp_path, caplog):
    """A workflow naming ~ (or any folder) as cache directory: refused, the model compiles without the cache."""
    from kiln.compiler.cache import describe_cache

    allowed, outside = tmp_path / "user", tmp_path / "home"
    outside.mkdir()
    options = CacheOptions(dir=str(outside), within=(str(allowed),))
    lowering = FakeLowering()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        compiled, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "unavailable" and "outside the directories a workflow may use" in event.reason
    assert "KILN_CACHE_DIR" in event.reason and lowering.compiles == 1 and compiled(1) == 1
    assert os.listdir(outside) == [] and "outside the directories" in caplog.text
    described = describe_cache(options)
    assert "cannot be used" in described.text and described.problem in described.text
    assert "outside the directories" in described.problem and os.listdir(outside) == []
    inside = CacheOptions(dir=str(allowed / "kiln-cache"), within=(str(allowed),))
    assert GraphCache(inside).lower(FakeLowering(), dict(FIELDS))[2].outcome == "miss"


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_a_link_below_the_allowed_directory_is_refused(tmp_path):
    allowed, outside = tmp_path / "user", tmp_path / "home"
    allowed.mkdir()
    outside.mkdir()
    os.symlink(outside, allowed / "link")
    options = CacheOptions(dir=str(allowed / "link" / "cache"), within=(str(allowed),))
    _, _, event = GraphCache(options).lower(FakeLowering(), dict(FIELDS))
    assert event.outcome == "unavailable" and "symbolic link" in event.reason and os.listdir(outside) == []


class KernelLowering:
    """A lowering of graph `graph` that runs `kernels`, like Inductor: a kernel is built once per process
    (`built` stands for Inductor's in-memory kernel cache) into the directory of the lowering that first
    needs it, and loaded from the current directory when it is there."""

    def __init__(self, graph: str, kernels: tuple, built: set):
        self.graph, self.kernels, self.built, self.builds = graph, kernels, built, 0

    def __call__(self):
        from torch._dynamo.utils import counters
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        record = os.path.join(cache_dir(), "fxgraph", self.graph)
        counters["inductor"]["fxgraph_cache_hit" if os.path.exists(record) else "fxgraph_cache_miss"] += 1
        os.makedirs(os.path.dirname(record), exist_ok=True)
        if not os.path.exists(record):
            open(record, "w").write("graph")
        for kernel in self.kernels:
            path = os.path.join(cache_dir(), "ke", kernel + ".so")
            if kernel in self.built or os.path.exists(path):
                self.built.add(kernel)
                continue
            self.builds += 1
            self.built.add(kernel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").write(kernel)
        return (lambda x: x), "inductor"


def test_an_entry_loaded_without_the_ones_before_it_brings_the_kernels_they_built(tmp_path):
    """Process 1 lowers A then B; B's kernel k2 was built into A's entry. Process 2 loads only B (A
    runs eagerly there): B's entry names A as needed, so k2 comes from A's entry, nothing is built."""
    options = CacheOptions(dir=str(tmp_path))
    first, built = GraphCache(options), set()
    first.lower(KernelLowering("A", ("k1", "k2"), built), dict(FIELDS, graph="A"))
    first.lower(KernelLowering("B", ("k2", "k3"), built), dict(FIELDS, graph="B"))
    first.write_record(dict(FIELDS, graph="choice"), "region-choice.json", b"{}")  # a record: no kernels, not needed
    store = CacheStore(str(tmp_path), 2**30)
    b_entry = store.read(entry_key(dict(FIELDS, graph="B")))
    assert sorted(b_entry.files) == ["fxgraph/B", "ke/k3.so", "kiln-needs.json"]
    assert json.loads(b_entry.files["kiln-needs.json"]) == [entry_key(dict(FIELDS, graph="A"))]
    lowering = KernelLowering("B", ("k2", "k3"), set())  # a new process: nothing built yet
    _, _, event = GraphCache(options).lower(lowering, dict(FIELDS, graph="B"))
    assert event.outcome == "hit" and lowering.builds == 0


def test_a_needs_list_that_is_not_one_is_ignored_and_inductor_builds_what_is_missing(tmp_path, caplog):
    options = CacheOptions(dir=str(tmp_path))
    first, built = GraphCache(options), set()
    first.lower(KernelLowering("A", ("k1", "k2"), built), dict(FIELDS, graph="A"))
    first.lower(KernelLowering("B", ("k2",), built), dict(FIELDS, graph="B"))
    store = CacheStore(str(tmp_path), 2**30)
    entry = store.read(entry_key(dict(FIELDS, graph="B")))
    hostile = {b'["../../etc/passwd"]': "not a list of at most 256 entry keys",
               b"[" * 100_000: "more than a list of 256 keys takes",
               b"[" * 5_000: "recursion"}  # under the size cap, nested past Python's recursion limit
    for data, said in hostile.items():
        entry.files["kiln-needs.json"] = data
        store.write(entry)  # signed with the user's key, yet not a list of keys: read as untrusted all the same
        lowering = KernelLowering("B", ("k2",), set())
        caplog.clear()
        _, _, event = GraphCache(options).lower(lowering, dict(FIELDS, graph="B"))
        assert event.outcome == "hit" and lowering.builds == 1
        assert "ignored its kiln-needs.json" in caplog.text and said in caplog.text


def _needs_of(store, fields) -> list:
    return json.loads(store.read(entry_key(fields)).files.get("kiln-needs.json", b"[]"))


def test_past_the_bound_the_needs_list_keeps_the_first_entries_which_hold_the_kernels(tmp_path, monkeypatch):
    from kiln.compiler.cache import graph_cache

    monkeypatch.setattr(graph_cache, "MAX_NEEDS", 1)
    cache, built = GraphCache(CacheOptions(dir=str(tmp_path))), set()
    for graph, kernels in (("A", ("k1",)), ("B", ("k1", "k2")), ("C", ("k1", "k2"))):
        cache.lower(KernelLowering(graph, kernels, built), dict(FIELDS, graph=graph))
    store = CacheStore(str(tmp_path), 2**30)
    assert _needs_of(store, dict(FIELDS, graph="C")) == [entry_key(dict(FIELDS, graph="A"))]  # A built k1


def _entry_b_needing_a(tmp_path):
    """Entries A (kernels k1, k2) and B (k2, built by A: B needs A), stored by one model:
    (options, store, A's key, B's key)."""
    options = CacheOptions(dir=str(tmp_path))
    first, built = GraphCache(options), set()
    first.lower(KernelLowering("A", ("k1", "k2"), built), dict(FIELDS, graph="A"))
    first.lower(KernelLowering("B", ("k2",), built), dict(FIELDS, graph="B"))
    return options, CacheStore(str(tmp_path), 2**30), entry_key(dict(FIELDS, graph="A")), entry_key(dict(FIELDS, graph="B"))


def test_a_needed_entry_that_cannot_be_read_is_not_handed_on(tmp_path):
    options, store, a_key, b_key = _entry_b_needing_a(tmp_path)
    os.remove(store.path(a_key))
    second = GraphCache(options)
    second.lower(KernelLowering("B", ("k2",), set()), dict(FIELDS, graph="B"))  # a hit that needs A, gone
    second.lower(KernelLowering("C", ("k3",), set()), dict(FIELDS, graph="C"))
    assert _needs_of(store, dict(FIELDS, graph="C")) == [b_key]


def test_a_needs_list_too_long_or_naming_a_damaged_entry_still_loads_its_own_entry(tmp_path, caplog):
    options, store, a_key, b_key = _entry_b_needing_a(tmp_path)
    with open(store.path(a_key), "r+b") as f:  # A's bytes damaged: its signature no longer holds
        f.seek(-40, os.SEEK_END)
        f.write(b"\0" * 8)
    lowering = KernelLowering("B", ("k2",), set())
    _, _, event = GraphCache(options).lower(lowering, dict(FIELDS, graph="B"))
    assert event.outcome == "hit" and lowering.builds == 1  # A refused: k2 built again, nothing else
    entry = store.read(b_key)
    entry.files["kiln-needs.json"] = json.dumps(["a" * 32] * 257).encode()
    store.write(entry)
    lowering = KernelLowering("B", ("k2",), set())
    _, _, event = GraphCache(options).lower(lowering, dict(FIELDS, graph="B"))
    assert event.outcome == "hit" and "not a list of at most 256 entry keys" in caplog.text


def _plant(store, written):
    """`written` signed with the store's key as it is, none of Kiln's write checks applied."""
    from kiln.compiler.cache import trust

    data = entry_module.encode(written)
    open(store.path(written.key), "wb").write(data + trust.sign(store._key, data))


@pytest.mark.parametrize("files", [{"fxgraph/entry": b"compiled", "fxgraph/entry/x": b"2"},
                                   {"fxgraph/entry": b"compiled", "ke/" + "k" * 256: b"2"}])
def test_a_signed_entry_whose_files_cannot_be_written_is_refused_and_the_cache_stays_on(tmp_path, files, caplog):
    """Such an entry once turned the cache off for the model ("cannot use the cache directory") and
    stayed, so that every start did the same."""
    options = CacheOptions(dir=str(tmp_path))
    store = CacheStore(str(tmp_path), options.max_bytes)
    key = entry_key(FIELDS)
    _plant(store, Entry(key=key, fields=dict(FIELDS), files=files, created=1.0))
    lowering = FakeLowering()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        compiled, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "miss" and "refused" in event.reason and lowering.compiles == 1 and compiled(5) == 5
    assert f"refused cache entry {store.path(key)}" in caplog.text and "damaged header" in caplog.text
    assert GraphCache(options).lower(FakeLowering(), dict(FIELDS))[2].outcome == "hit"  # stored afresh


def test_a_needed_file_whose_name_the_entrys_own_files_take_is_left_out(tmp_path):
    """Entry B's own file ke/k3.so makes ke a folder; the entry it needs has a file named ke."""
    options = CacheOptions(dir=str(tmp_path))
    store = CacheStore(str(tmp_path), options.max_bytes)
    needed = Entry(key="a" * 32, fields={"graph": "A"}, files={"ke": b"kernel", "ke2/k/x.so": b"kernel"})
    store.write(needed)
    store.write(Entry(key=entry_key(FIELDS), fields=dict(FIELDS), files={
        "fxgraph/entry": b"compiled", "ke/k3.so": b"kernel", "ke2/k": b"kernel",
        "kiln-needs.json": json.dumps(["a" * 32]).encode()}))
    lowering = FakeLowering()
    _, _, event = GraphCache(options).lower(lowering, dict(FIELDS))
    assert event.outcome == "hit" and lowering.compiles == 0


def test_an_entry_too_large_to_store_leaves_the_cache_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(entry_module, "MAX_ENTRY_BYTES", 100)
    options = CacheOptions(dir=str(tmp_path))
    cache = GraphCache(options)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _, _, event = cache.lower(FakeLowering(), dict(FIELDS))
    assert event.outcome == "miss" and "not stored" in event.reason and "more than the limit" in event.reason
    assert not cache.unavailable and cache.store() is not None
