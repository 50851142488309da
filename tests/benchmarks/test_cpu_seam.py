"""`python -m kiln.benchmarks.cpu_seam` (benchmarks/cpu_seam.py) must not rot: each variant turns off
something compiler/cpu really has, the variants alternate, and each row's share is against as shipped."""
import argparse

from kiln.benchmarks import cpu_seam
from kiln.compiler import cpu


def test_each_variant_turns_off_an_attribute_the_cpu_seam_has():
    for variant, toggle in cpu_seam.VARIANTS.items():
        if not toggle:
            continue
        target = toggle.split("=")[0].strip()
        owner, _, name = target.rpartition(".")
        module = {"cpu": cpu, "cpu.lowering": cpu.lowering}[owner]
        assert hasattr(module, name), variant


def test_variants_alternate_and_shares_are_against_as_shipped(monkeypatch, capsys):
    seen = []
    times = {"as shipped": 10.0, "without the convolution rule": 15.0, "probe one set after another": 11.0,
             "Inductor's registered backend": 12.0}

    def child(variant, run, args, cache_dir, inductor_dir, temp_dir):
        seen.append((variant, run, cache_dir, inductor_dir))
        return {"variant": variant, "run": run, "first_step_s": times[variant] / (1 if run == "kiln cold" else 5)}

    monkeypatch.setattr(cpu_seam, "_child", child)
    args = argparse.Namespace(model="sd15", size="tiny", dtype="fp32", batch=2, rounds=2)
    result = cpu_seam.run_cpu_seam(args, log=lambda msg: None)
    order = [variant for variant, run, _, _ in seen if run == "kiln cold"]
    assert order == list(cpu_seam.VARIANTS) + list(cpu_seam.VARIANTS)[::-1]
    for variant in cpu_seam.VARIANTS:  # a variant's warm run reads the cache and folders its cold run filled
        cold, warm = [(c, i) for v, r, c, i in seen[:8] if v == variant]
        assert cold == warm
    assert result["summary"]["kiln cold"]["without the convolution rule"]["adds"] == 0.5
    assert result["summary"]["kiln warm"]["as shipped"]["median_s"] == 2.0
    assert "+50%" in cpu_seam.format_table(result)
