import json

from kiln.benchmarks import bench
from kiln.cli import main


def test_kiln_bench_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", "sd3", "--size", "tiny", "--modes", "fast", "--rounds", "2", "--steps", "1", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "eager" in table and "torch.compile" in table and "kiln fast" in table
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eager"]["speedup"] == 1.0
    assert rows["kiln fast"]["max_rel_err"] < 1e-4 and rows["torch.compile"]["max_rel_err"] < 1e-4
    assert rows["kiln fast"]["graphs"] == 1


def test_table_shows_failures():
    result = {"rows": [{"variant": "kiln max", "error": "BackendCompilerFailed: boom"}]}
    assert "kiln max                FAILED: BackendCompilerFailed: boom" in bench.format_table(result)
