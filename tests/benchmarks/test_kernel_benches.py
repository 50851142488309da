"""Each kernel benchmark still runs (CPU smoke run at small shapes: eager, Inductor and the Kiln op
all time without error), so the GPU run that needs them does not find them broken."""
import importlib
import json

import pytest


@pytest.mark.parametrize("name", ["bench_geglu", "bench_group_norm_silu", "bench_layer_norm_modulate"])
def test_kernel_bench_small(name, tmp_path, capsys):
    module = importlib.import_module(f"kiln.benchmarks.{name}")
    out = tmp_path / "rows.json"
    module.main(["--small", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert rows and all(not any(key.endswith("_error") for key in row) for row in rows), rows
    assert all(row[f"{variant}_ms"] > 0 for row in rows for variant in ("eager", "inductor", "kiln"))
    assert "kiln vs inductor" in capsys.readouterr().out
