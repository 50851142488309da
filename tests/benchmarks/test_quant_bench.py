"""`kiln bench --quant` runs every variant side by side and reports weights, time and error."""
from kiln.benchmarks.quant_bench import format_table, run_quant_bench


def test_quant_bench_tiny():
    result = run_quant_bench("sd15", "tiny", schemes=("int8_weight", "fp8_e4m3"), mode="fast", policy="min_params: 0",
                             rounds=1, steps=1, log=lambda msg: None)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "kiln fast", "int8_weight eager", "int8_weight + kiln fast", "fp8_e4m3 eager",
                         "fp8_e4m3 + kiln fast"}
    assert all(r["error"] is None and r["step_ms"] > 0 for r in rows.values())
    assert rows["int8_weight eager"]["weight_vs_eager"] < 0.5  # fp32 -> int8 for most weights
    assert rows["kiln fast"]["rel_l2_err"] < 1e-5 and 0 < rows["int8_weight + kiln fast"]["rel_l2_err"] < 0.05
    assert abs(rows["int8_weight + kiln fast"]["rel_l2_err"] - rows["int8_weight eager"]["rel_l2_err"]) < 1e-5
    table = format_table(result)
    assert "int8_weight + kiln fast" in table and "layers quantized/kept: int8_weight" in table
