"""The quantized-Linear benchmark still runs (CPU smoke run at a small odd shape: each op's eager
reference, its Inductor compile and the Kiln op all time without error, beside the dense F.linear)."""
import json

from kiln.benchmarks import bench_int8_linear


def test_int8_linear_bench_small(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench_int8_linear.main(["--small", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert {row["kernel"] for row in rows} == {"int8_weight_linear", "int8_dynamic_linear", "fp8_weight_linear"}
    assert all(not any(key.endswith("_error") for key in row) for row in rows), rows
    assert all(row[f"{variant}_ms"] > 0 for row in rows for variant in ("eager", "inductor", "kiln", "dense"))
    printed = capsys.readouterr().out
    assert "kiln vs inductor" in printed and "kiln vs dense" in printed
