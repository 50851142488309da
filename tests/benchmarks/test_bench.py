import json

from kiln.benchmarks import bench
from kiln.cli import main


def test_kiln_bench_prints_the_table_and_writes_json(tmp_path, capsys):
    """On the tiny VAE decoder, cheaper to compile than the tiny SD3: the command is what is checked here."""
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", "vae", "--size", "tiny", "--modes", "fast", "--rounds", "2", "--steps", "1", "--json", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    table = captured.out
    # the warm-up compile pays the process's one-time costs before any variant is timed (and logged
    # with its time, which warm_up_compiler returns), so torch.compile, timed first, does not pay them
    events = [line for line in captured.err.splitlines() if line.startswith(("kiln bench:", "  "))]  # its own lines
    assert events[0].startswith("kiln bench:") and events[1].startswith("  warm-up compile")
    assert events[2].startswith("  eager: first call") and all(": first call" in e for e in events[2:])
    assert "eager" in table and "torch.compile" in table and "kiln fast" in table
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eager"]["speedup"] == 1.0
    assert rows["kiln fast"]["max_rel_err"] < 1e-4 and rows["torch.compile"]["max_rel_err"] < 1e-4
    assert rows["kiln fast"]["graphs"] == 1
    assert json.loads(out.read_text())["warm_up_s"] > 0


def test_table_shows_failures():
    result = {"rows": [{"variant": "kiln max", "error": "BackendCompilerFailed: boom"}]}
    assert "kiln max                FAILED: BackendCompilerFailed: boom" in bench.format_table(result)


def test_all_regions_adds_a_kiln_row_that_compiles_every_region_beside_each_unit_but_whole():
    import torch

    from kiln import compiler as kiln

    module = torch.nn.Linear(4, 4)
    variants = bench._variants(module, ["balanced"], None, ("auto", "whole"), all_regions=True)
    assert [name for name in variants if name.startswith("kiln")] == ["kiln balanced", "kiln balanced all regions",
                                                                       "kiln balanced whole"]
    assert kiln.stats(variants["kiln balanced"]).options["measure_regions"] is True
    assert kiln.stats(variants["kiln balanced all regions"]).options["measure_regions"] is False


def test_on_a_gpu_each_kiln_row_has_a_cuda_graphs_row_beside_it():
    """`kiln bench --device cuda` shows torch's CUDA graph trees per compiled graph (`+ cudagraphs`) beside
    each Kiln row, whose default (`cuda_graphs` auto) replays the whole call (the rows are made here, not run)."""
    import torch

    from kiln import compiler as kiln

    module = torch.nn.Linear(4, 4)
    names = [name for name in bench._variants(module, ["balanced"], None, ("auto",)) if name.startswith("kiln")]
    assert names == ["kiln balanced"]  # a CPU has none
    variants = bench._variants(module, ["balanced", "fast"], None, ("auto", "whole"), device="cuda")
    assert [name for name in variants if name.startswith("kiln")] == [
        "kiln balanced", "kiln balanced + cudagraphs", "kiln balanced whole", "kiln balanced whole + cudagraphs",
        "kiln fast", "kiln fast + cudagraphs", "kiln fast whole", "kiln fast whole + cudagraphs"]
    assert kiln.stats(variants["kiln fast whole + cudagraphs"]).options["cuda_graphs"] is True
    assert kiln.stats(variants["kiln balanced"]).options["cuda_graphs"] is None  # auto, Kiln's default: the whole call
