"""`kiln cache list|info|clear|export|import` on a cache with stand-in entries."""
import os

from kiln.cli import main
from kiln.compiler.cache import CacheStore, Entry, environment_fields


def populate(root, keys=("a" * 32, "b" * 32)):
    store = CacheStore(str(root), max_bytes=2**30)
    for key in keys:
        fields = {"graph": "g", "label": f"UNetModel graph {key[0]}", **environment_fields("cpu")}
        store.write(Entry(key=key, fields=fields, files={"fxgraph/x": b"code"}, compile_seconds=42.0))
    return store


def test_list_and_info(tmp_path, capsys):
    populate(tmp_path / "c")
    assert main(["cache", "--dir", str(tmp_path / "c"), "list"]) == 0
    out = capsys.readouterr().out
    assert "UNetModel graph a" in out and "42.0s" in out and "2 entries" in out
    assert main(["cache", "--dir", str(tmp_path / "c"), "info", "aaaa"]) == 0
    out = capsys.readouterr().out
    assert "signature OK" in out and "usable on this machine" in out and '"label": "UNetModel graph a"' in out


def test_info_names_what_makes_an_entry_unusable_here(tmp_path, capsys):
    store = populate(tmp_path / "c", keys=("c" * 32,))
    entry = store.read("c" * 32)
    entry.fields["torch"] = "2.1.0"
    store.write(entry)
    main(["cache", "--dir", str(tmp_path / "c"), "info", "c"])
    assert "NOT usable on this machine: torch: 2.1.0 ->" in capsys.readouterr().out


def test_info_weighs_only_the_fields_an_entry_is_keyed_by(tmp_path, capsys):
    from kiln.compiler.cache import entry_key
    from kiln.compiler.cache.key import environment_fields

    store = CacheStore(str(tmp_path / "c"), max_bytes=2**30)
    here = environment_fields("cpu")
    # an entry keyed by the machine, torch and Python only: not by Kiln's or Triton's version
    fields = {"record": "a test record", **{name: here[name] for name in ("device", "torch", "python")}}
    store.write(Entry(key=entry_key(fields), fields=fields, files={"ab/c.so": b"x"}, compile_seconds=6.0))
    assert main(["cache", "--dir", str(tmp_path / "c"), "info", entry_key(fields)[:8]]) == 0
    out = capsys.readouterr().out
    assert "a test record" in out and "usable on this machine" in out and "NOT" not in out


def test_clear_export_import(tmp_path, capsys):
    populate(tmp_path / "c")
    bundle = str(tmp_path / "entries.tar")
    assert main(["cache", "--dir", str(tmp_path / "c"), "export", bundle, "aa"]) == 0
    assert main(["cache", "--dir", str(tmp_path / "other"), "import", bundle]) == 0
    assert "1 entries signed with this cache's key" in capsys.readouterr().out
    assert CacheStore(str(tmp_path / "other"), 2**30).read("a" * 32).files == {"fxgraph/x": b"code"}
    assert main(["cache", "--dir", str(tmp_path / "c"), "clear", "b"]) == 0
    assert [k for k, _, _ in CacheStore(str(tmp_path / "c"), 2**30).headers()] == ["a" * 32]
    assert main(["cache", "--dir", str(tmp_path / "c"), "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out


def test_errors_are_one_line_with_a_non_zero_exit(tmp_path, capsys):
    populate(tmp_path / "c")
    assert main(["cache", "--dir", str(tmp_path / "c"), "info", "zzz"]) == 1
    assert "'zzz' names 0 entries" in capsys.readouterr().out
    if os.name == "posix":
        os.chmod(tmp_path / "c", 0o777)
        assert main(["cache", "--dir", str(tmp_path / "c"), "list"]) == 1
        assert "can be written by other users" in capsys.readouterr().out


def test_list_shows_a_damaged_entry_and_goes_on(tmp_path, capsys):
    store = populate(tmp_path / "c")
    with open(store.path("b" * 32), "r+b") as f:  # a header that is no longer JSON
        f.seek(len(b"KILN-CACHE-ENTRY 1\n") + 8)
        f.write(b"\x80")
    assert main(["cache", "--dir", str(tmp_path / "c"), "list"]) == 0
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and "UNetModel graph a" in out


def test_a_time_the_system_cannot_show_is_shown_as_unknown(tmp_path, capsys):
    """An entry file's mtime set far off (or an imported `created` far off, now refused) once made
    `kiln cache list` and `info` die with a traceback."""
    from kiln.compiler.cache import commands

    assert commands._when(1e300) == "?" and commands._when(float("nan")) == "?" and commands._when(0) == "-"
    store = populate(tmp_path / "c")
    try:
        os.utime(store.path("a" * 32), (2**40, 2**40))
    except (OSError, OverflowError):
        return  # a file system that cannot hold such a time
    assert main(["cache", "--dir", str(tmp_path / "c"), "list"]) == 0
    assert "UNetModel graph a" in capsys.readouterr().out


def test_import_of_a_compressed_or_truncated_file_is_one_line(tmp_path, capsys):
    import tarfile

    populate(tmp_path / "c")
    bundle = str(tmp_path / "entries.tar")
    assert main(["cache", "--dir", str(tmp_path / "c"), "export", bundle]) == 0
    with tarfile.open(bundle, "r:") as tar, tarfile.open(str(tmp_path / "entries.tar.gz"), "w:gz") as packed:
        for member in tar.getmembers():
            packed.addfile(member, tar.extractfile(member))
    data = open(bundle, "rb").read()
    open(tmp_path / "cut.tar", "wb").write(data[:1200])  # inside the second entry
    capsys.readouterr()
    for name in ("entries.tar.gz", "cut.tar"):
        assert main(["cache", "--dir", str(tmp_path / "other"), "import", str(tmp_path / name)]) == 1
        out = capsys.readouterr().out
        assert out.startswith("kiln cache import: ") and "not a whole file made by `kiln cache export`" in out
