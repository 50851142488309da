"""The GPU suite must not rot between GPU runs: run it on the CPU with tiny models."""
import json
from pathlib import Path

import pytest
import torch

from kiln.benchmarks import gpu_suite


def test_tiny_suite_writes_results_and_log(tmp_path, monkeypatch):
    def broken(module):
        raise RuntimeError("no kernel for this")

    monkeypatch.setitem(gpu_suite.VARIANTS, "broken", broken)
    code = gpu_suite.main(["--tiny", "--cases", "vae-decode-tiny", "--variants", "eager,kiln fast,broken", "--out", str(tmp_path)])
    assert code == 0
    (result_file,) = tmp_path.glob("*.json")
    data = json.loads(result_file.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert rows["eager"]["speedup"] == 1.0 and rows["eager"]["rel_err"] == 0.0
    assert rows["kiln fast"]["error"] is None and rows["kiln fast"]["rel_err"] < 1e-4
    assert 0 < rows["kiln fast"]["ceiling_fraction"] and rows["kiln fast"]["tflops"] > 0
    assert rows["broken"]["error"] == "RuntimeError: no kernel for this"  # recorded, the rest still ran
    assert rows["kiln fast"]["busy_ms"] is None  # the GPU's busy time: CUDA only
    # eager timed again after the others, last: how far the conditions moved over the run
    assert data["results"][-1]["variant"] == gpu_suite.EAGER_AGAIN
    again = rows[gpu_suite.EAGER_AGAIN]
    assert again["error"] is None and again["ms"] > 0 and again["rel_err"] == 0.0
    assert again["speedup"] == pytest.approx(rows["eager"]["ms"] / again["ms"])
    assert "FAILED" in result_file.with_suffix(".log").read_text()
    # the process's one-time compile costs are paid before the first variant, not by it
    assert data["warm_up_s"] > 0 and "warm-up compile" in result_file.with_suffix(".log").read_text()


def test_eager_is_not_timed_again_when_it_ran_alone_or_failed(tmp_path, monkeypatch):
    assert gpu_suite.main(["--tiny", "--cases", "vae-decode-tiny", "--variants", "eager", "--out", str(tmp_path / "a")]) == 0
    rows = json.loads(next((tmp_path / "a").glob("*.json")).read_text())["results"]
    assert [r["variant"] for r in rows] == ["eager"]

    def broken(module):
        raise RuntimeError("no eager today")

    monkeypatch.setitem(gpu_suite.VARIANTS, "eager", broken)
    assert gpu_suite.main(["--tiny", "--cases", "vae-decode-tiny", "--variants", "eager,kiln fast",
                           "--out", str(tmp_path / "b")]) == 0
    rows = json.loads(next((tmp_path / "b").glob("*.json")).read_text())["results"]
    assert [r["variant"] for r in rows] == ["eager", "kiln fast"]  # no eager row to compare with


def test_a_run_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    def stopped(module):  # what a time limit does to the part in the middle of a row
        raise KeyboardInterrupt

    monkeypatch.setitem(gpu_suite.VARIANTS, "stopped", stopped)
    with pytest.raises(KeyboardInterrupt):
        gpu_suite.main(["--tiny", "--cases", "vae-decode-tiny", "--variants", "eager,kiln fast,stopped,kiln max",
                        "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    assert [r["variant"] for r in rows] == ["eager", "kiln fast"] and rows[1]["ms"] > 0


def test_results_page_table_is_regenerated_after_the_marker(tmp_path):
    page = tmp_path / "gpu-results.md"
    page.write_text(f"# GPU results\n\nwhat each run was\n{gpu_suite.MARK}\nold table\n")
    data = {"date": "2026-11-22", "ceiling_tflops": 790.0, "machine": {"device": "NVIDIA H100", "torch": "2.11"},
            "results": [{"case": "sd15-512-cfg", "variant": "kiln balanced", "ms": 10.0, "speedup": 2.0, "ceiling_fraction": 0.2,
                         "compile_s": 60.0, "peak_mem_gb": 3.0, "rel_err": 1e-3, "error": None},
                        {"case": "sd15-512-cfg", "variant": "kiln max", "error": "OOM"}]}
    gpu_suite.update_results_page(data, page)
    text = page.read_text()
    assert "old table" not in text and text.startswith("# GPU results\n\nwhat each run was\n")  # the text above is kept
    assert "| sd15-512-cfg | kiln balanced | 10.00 | - | 2.00x | 20.0% | 60 | 3.0 | 1.0e-03 |" in text  # no busy time kept
    assert "| sd15-512-cfg | kiln max | failed: OOM |" in text
    data["results"][0]["busy_ms"] = 4.5
    gpu_suite.update_results_page(data, page, sources=["benchmarks/results/2026-11-22-h100.json"])
    text = page.read_text()
    assert "| sd15-512-cfg | kiln balanced | 10.00 | 4.50 | 2.00x |" in text
    assert "Results file: `benchmarks/results/2026-11-22-h100.json`." in text  # every table names its run's file


def test_a_gpu_runs_table_joins_the_earlier_ones(tmp_path):
    """After a GPU run its table goes last and every earlier run's stays, but one from the same file."""
    page = tmp_path / "gpu-results.md"
    page.write_text(f"x\n{gpu_suite.MARK}\n")

    def run(date, ms):
        return {"date": date, "ceiling_tflops": 1.0, "machine": {"device": "H200", "torch": "2.11"},
                "results": [{"case": "c", "variant": "eager", "ms": ms, "speedup": 1.0, "ceiling_fraction": 0.1,
                             "compile_s": 0.0, "peak_mem_gb": None, "rel_err": 0.0, "error": None}]}

    gpu_suite.update_results_page(run("a", 1.0), page, sources=["a.json"], keep=True)
    gpu_suite.update_results_page(run("b", 2.0), page, sources=["b.json"], keep=True)
    text = page.read_text()
    assert text.index("GPU suite, a,") < text.index("GPU suite, b,")  # the newest last, none dropped
    gpu_suite.update_results_page(run("a", 3.0), page, sources=["a.json"], keep=True)  # the same file again
    text = page.read_text()
    assert text.count("GPU suite, a,") == 1 and "| c | eager | 3.00 |" in text and "| c | eager | 1.00 |" not in text
    assert text.index("GPU suite, b,") < text.index("GPU suite, a,")  # a run's new table goes last
    assert text.startswith(f"x\n{gpu_suite.MARK}\n") and text.count("GPU suite, b,") == 1


def test_results_page_from_results_files(tmp_path, monkeypatch):
    page = tmp_path / "gpu-results.md"
    page.write_text(f"x\n{gpu_suite.MARK}\n")
    monkeypatch.setattr(gpu_suite, "RESULTS_PAGE", page)
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"date": "d", "ceiling_tflops": 1.0, "machine": {"device": "H100", "torch": "2.11"}, "results": []}))
    assert gpu_suite.main(["--table-from", str(results)]) == 0
    assert "GPU suite, d, H100" in page.read_text() and "Results file: `r.json`." in page.read_text()
    other = tmp_path / "s.json"  # the parts of one GPU run: a table each, in the order given
    other.write_text(json.dumps({"date": "e", "ceiling_tflops": 1.0, "machine": {"device": "H200", "torch": "2.11"}, "results": []}))
    assert gpu_suite.main(["--readme-from", str(results), str(other)]) == 0  # the option's old name still works
    text = page.read_text()
    assert text.index("GPU suite, d, H100") < text.index("GPU suite, e, H200")


def test_the_results_page_exists_with_its_marker():
    """The suite writes its tables into docs/gpu-results.md, after the marker (not into the README)."""
    assert gpu_suite.MARK in gpu_suite.RESULTS_PAGE.read_text()


def test_every_variant_can_be_named_in_variants():
    """--variants splits on commas: a name with one could not be asked for (seen on a CUDA machine)."""
    assert all("," not in name for name in gpu_suite.VARIANTS)


def test_flop_count_is_the_matmul_count():
    lin = torch.nn.Linear(16, 8, bias=False)
    assert gpu_suite.model_flops(lambda: lin(torch.randn(4, 16))) == 2 * 4 * 16 * 8


@pytest.mark.slow
def test_quantized_variants_run_and_report_their_weights(tmp_path):
    """On the VAE decoder (its convolutions and its attention's linear layers quantized), cheaper to compile than
    the tiny SD3: the suite's quantized path is what is checked here. A quantized transformer through
    Inductor: tests/quantize/test_quantize_models.py."""
    code = gpu_suite.main(["--tiny", "--cases", "vae-decode-tiny", "--variants", "eager,kiln balanced + int8_dynamic",
                           "--out", str(tmp_path)])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads(next(tmp_path.glob("*.json")).read_text())["results"]}
    quantized = rows["kiln balanced + int8_dynamic"]
    assert quantized["error"] is None and quantized["weight_gb"] < rows["eager"]["weight_gb"]


def test_quant_targets_compare_with_kilns_own_compile():
    rows = [{"case": "flux-1024", "variant": "kiln balanced", "ms": 100.0, "weight_gb": 22.0, "error": None},
            {"case": "flux-1024", "variant": "kiln balanced + fp8_e4m3", "ms": 70.0, "weight_gb": 11.5, "error": None},
            {"case": "flux-1024", "variant": "kiln balanced + int8_dynamic", "ms": 80.0, "weight_gb": 11.5, "error": None}]
    (target,) = gpu_suite.quant_targets(rows)
    assert target["variant"] == "kiln balanced + fp8_e4m3" and target["met"]
    assert abs(target["speedup_vs_kiln"] - 100 / 70) < 1e-9
    rows[1]["weight_gb"] = 13.0
    assert not gpu_suite.quant_targets(rows)[0]["met"]  # 59% of the weights: over the 55% target


def test_kilns_default_row_comes_first_in_a_fresh_cache_and_is_scored_on_a_replays_output(tmp_path, monkeypatch):
    """Issue 57's honest suite: `kiln default` (no option set) is timed first, every variant compiles in a
    fresh Inductor and Triton cache, speeds are against the eager row wherever it stands, and a variant is
    scored on an output taken after its timing and copied at once (a CUDA-graph replay overwrites the
    outputs of earlier calls: scored on its first output, such a variant read garbage)."""
    import contextlib

    assert list(gpu_suite.VARIANTS)[0] == "kiln default"
    assert "torch.compile reduce-overhead" in gpu_suite.VARIANTS
    fresh = []

    @contextlib.contextmanager
    def counted():
        fresh.append(1)
        yield

    monkeypatch.setattr(gpu_suite, "fresh_inductor_cache", counted)

    class Replaying(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module, self.given = module, []

        def forward(self, *args, **kwargs):
            for earlier in self.given:  # as a replay does: the memory of earlier outputs is reused
                earlier.fill_(float("nan"))
            out = self.module(*args, **kwargs)
            self.given.append(out[0])
            return out

    replaying = Replaying

    monkeypatch.setitem(gpu_suite.VARIANTS, "replaying", replaying)
    assert gpu_suite.main(["--tiny", "--cases", "vae-decode-tiny", "--variants", "kiln default,replaying,eager",
                           "--out", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in json.loads(next(tmp_path.glob("*.json")).read_text())["results"]}
    assert len(fresh) == 3  # one fresh cache per variant
    assert rows["kiln default"]["error"] is None and rows["kiln default"]["rel_err"] < 1e-4
    assert rows["kiln default"]["speedup"] == pytest.approx(rows["eager"]["ms"] / rows["kiln default"]["ms"])
    assert rows["replaying"]["rel_err"] == 0.0  # its output read right after its call


def test_kernel_tables_are_named_by_case_and_row_and_list_the_costliest():
    from torch.profiler import ProfilerActivity, profile

    from kiln.benchmarks.gpu_suite import KERNEL_TABLE_ROWS, kernel_table, table_path

    assert table_path(Path("r"), "sd15-512-cfg", "torch.compile reduce-overhead") == \
        Path("r/kernels-sd15-512-cfg-torch-compile-reduce-overhead.txt")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    text = kernel_table(prof, "self_cpu_time_total", "1 call")
    assert text.startswith("torch.profiler, 1 call, by self_cpu_time_total\n") and "aten::mm" in text
    assert KERNEL_TABLE_ROWS == 40
