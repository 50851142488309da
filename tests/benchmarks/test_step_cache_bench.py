"""`kiln bench --step-cache` (benchmarks/step_cache_bench.py) must not rot: the digits denoiser, one seed,
20 steps, Kiln's fast compile. Needs the trained digits denoiser (cached, or scikit-learn to train it)."""
import pytest

from kiln.benchmarks import step_cache_bench
from kiln.choices import DEFAULT_STEP_CACHE_METHOD, STEP_CACHE_THRESHOLDS
from kiln.testing import digits_unet

pytestmark = [pytest.mark.slow, pytest.mark.trained_denoiser]
if not digits_unet.cache_path().exists():
    pytest.importorskip("sklearn", reason="the digits denoiser is not trained yet and scikit-learn is missing")


def test_one_seed_of_each_setting_eager_and_the_default_compiled():
    result = step_cache_bench.run_step_cache_bench(seeds=1, step_counts=(20,), mode="fast", models=("digits",),
                                                   log=lambda msg: None)
    rows = {(r["model"], r["method"], r["threshold"]): r for r in result["rows"]}
    assert len(rows) == 1 + len(step_cache_bench.SETTINGS) + 2
    assert step_cache_bench.SETTINGS[0] == (DEFAULT_STEP_CACHE_METHOD, STEP_CACHE_THRESHOLDS[DEFAULT_STEP_CACHE_METHOD])
    for model, settings in (("eager", STEP_CACHE_THRESHOLDS.items()), ("kiln fast", step_cache_bench.SETTINGS[:1])):
        assert rows[(model, None, None)]["computed"] == 20
        for method, threshold in settings:   # each method's default skips and stays near
            row = rows[(model, method, threshold)]
            assert row["computed"] <= 20 / 1.6 and row["psnr_min"] >= 30 and row["ssim_min"] > 0.95, row
            assert row["seconds"] > 0 and len(row["pattern"]) == 20 and 0 < row["error_spent"] <= 1
            assert row["bench_model"] == "digits unet" and row["chosen_on"]
    assert " 20 steps  eager" in step_cache_bench.format_row(rows[("eager", "reuse", STEP_CACHE_THRESHOLDS["reuse"])])
