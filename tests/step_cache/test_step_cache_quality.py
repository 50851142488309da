"""The step cache on a trained model (testing/digits_unet.py, trained once into the user's cache):
its images against their uncached twins, compiled and eager alike, and no recompile when its
settings change. Random weights would make every skip decision meaningless."""
import pytest
import torch

import kiln
from kiln.choices import STEP_CACHE_METHODS
from kiln.testing.image_quality import psnr

pytest.importorskip("sklearn")
pytestmark = [pytest.mark.slow, pytest.mark.trained_denoiser]

from kiln.testing import digits_unet  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return digits_unet.load_or_train()


@pytest.mark.parametrize("method", STEP_CACHE_METHODS)
def test_each_method_s_default_skips_steps_and_keeps_every_image_within_30_db(model, method):
    for steps in (20, 30):
        computed = 0
        for seed in range(4):
            reference = digits_unet.sample(model, torch.tensor([seed]), steps, seed)
            cached = kiln.step_cached(model, {"method": method})
            out = digits_unet.sample(cached, torch.tensor([seed]), steps, seed)
            assert psnr(out, reference) >= 30, (steps, seed, cached.report().line())
            computed += cached.report().computed
            assert cached.report().patterns["all"].startswith("CC") and cached.report().patterns["all"].endswith("C")
        assert computed <= 4 * steps / 1.6, (steps, computed)  # at least 1.6x fewer model evaluations


def test_compiled_and_eager_decide_alike_and_new_settings_never_recompile(model):
    compiled = digits_unet.DigitsDenoiser(kiln.compile(model.unet, mode="fast"), model.embed)
    runs = [({"threshold": 0.05}, 30, [1]), ({"threshold": 0.08, "max_consecutive_skips": 3}, 20, [2, 7]),
            ({"method": "first_block"}, 20, [3]), ({"threshold": 0.0}, 12, [4])]
    counts = []
    for options, steps, classes in runs:
        eager = kiln.step_cached(model, options)
        cached = kiln.step_cached(compiled, options)
        a = digits_unet.sample(eager, torch.tensor(classes), steps, seed=5)
        b = digits_unet.sample(cached, torch.tensor(classes), steps, seed=5)
        assert cached.report().patterns == eager.report().patterns
        assert psnr(b, a) > 60, options
        counts.append(kiln.stats(compiled.unet).compile_count)
    assert counts[0] == counts[-1] and not kiln.stats(compiled.unet).recompiles  # threshold, steps, batch: no compile
