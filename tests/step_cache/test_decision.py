"""The step cache's rule and state (compiler/step_cache/decision.py), on models whose outputs are known."""
import pytest
import torch

import kiln
from kiln.choices import MAX_ERROR_BUDGET
from kiln.compiler import StepCache, StepCacheError, StepCacheOptions, step_cached


class Settling(torch.nn.Module):
    """A 'denoiser' whose output moves less and less as sampling goes on, like a trained one's."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, t, *rest):
        self.calls += 1
        return 0.5 * x + torch.tanh(x) * 0.1 + 0.01 * t.reshape(-1, *[1] * (x.dim() - 1)) / 1000


def _run(model, steps=30, shape=(2, 4, 8, 8), seed=0):
    """A sampling loop: x moves toward the model's output, by less each step."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    for i, t in enumerate(torch.linspace(999, 0, steps)):
        out = model(x, t.repeat(shape[0]))
        x = x + (out - x) / (i + 2)
    return x


def test_threshold_zero_computes_every_step_and_gives_the_uncached_result_bit_for_bit():
    plain = _run(Settling())
    model = Settling()
    cached = step_cached(model, {"threshold": 0})
    assert torch.equal(_run(cached), plain)
    assert model.calls == 30 and cached.report().skipped == 0


def test_skips_stay_inside_the_window_and_the_consecutive_bound():
    options = StepCacheOptions(threshold=0.5, start_percent=0.2, end_percent=0.9, max_consecutive_skips=2)
    model = Settling()
    cached = step_cached(model, options)
    _run(cached, steps=30)
    pattern = cached.report().patterns["all"]
    assert len(pattern) == 30 and pattern.count("s") > 0 and model.calls == pattern.count("C")
    assert "sss" not in pattern                                            # at most 2 in a row
    progress = [i / 29 * 999 / 1000 for i in range(30)]                     # 1 - t / 1000 at each step
    assert all(c == "C" for c, p in zip(pattern, progress) if not 0.2 <= p < 0.9)  # first and last steps compute
    assert 0 < cached.report().estimate_used < 0.5
    assert "model calls computed" in cached.report().line()


def test_a_skipped_step_answers_its_input_plus_the_last_computed_change():
    cache = StepCache(StepCacheOptions(threshold=10, error_budget=10, start_percent=0, max_consecutive_skips=100))
    outs = [cache.step(torch.full((1, 2), float(v)), p, lambda v=v: torch.full((1, 2), 2.0 * v))
            for p, v in ((0.0, 1), (0.1, 2), (0.2, 3))]
    assert cache.report().patterns["all"] == "CCs"
    assert torch.equal(outs[2], torch.full((1, 2), 3.0 + (4.0 - 2.0)))      # x + (out - x) of step 2


def test_a_new_run_starts_fresh_and_keeps_the_last_report():
    cached = step_cached(Settling(), {"threshold": 0.5, "start_percent": 0.1})
    _run(cached, steps=20)
    first = cached.report()
    _run(cached, steps=12, shape=(1, 4, 6, 10), seed=1)  # another size and step count: progress goes back
    assert cached.cache.last_report.patterns == first.patterns
    assert len(cached.report().patterns["all"]) == 12


def test_a_new_input_shape_within_a_run_never_reuses_a_change_of_another_shape():
    cache = StepCache(StepCacheOptions(threshold=10, error_budget=10, start_percent=0, max_consecutive_skips=100))
    for p in (0.0, 0.1, 0.2):
        cache.step(torch.ones(1, 4), p, lambda: torch.ones(1, 4) * 2)
    out = cache.step(torch.ones(2, 4), 0.3, lambda: torch.zeros(2, 4))
    assert torch.equal(out, torch.zeros(2, 4)) and cache.report().patterns["all"].endswith("C")


def test_the_first_cond_decides_and_the_others_follow_when_they_can():
    cache = StepCache(StepCacheOptions(threshold=10, error_budget=10, start_percent=0, max_consecutive_skips=100))
    for p in (0.0, 0.1, 0.2, 0.3):
        cache.step(torch.full((1, 2), p), p, lambda p=p: torch.full((1, 2), 2 * p), key="cond")
        if p >= 0.2:  # the uncond joins late: nothing of its own to reuse, so it computes
            cache.step(torch.full((1, 2), p), p, lambda p=p: torch.full((1, 2), 3 * p), key="uncond")
    patterns = cache.report().patterns
    assert patterns["cond"] == "CCss" and patterns["uncond"] == "Cs"


@pytest.mark.parametrize("field, value, words", [
    ("threshold", -2, "threshold=-2"), ("threshold", float("nan"), "threshold=nan"), ("threshold", "0.2", "use a number"),
    ("method", "magic", "use one of reuse"), ("max_consecutive_skips", 10 ** 9, "max_consecutive_skips"),
    ("start_percent", 0.97, "start_percent=0.97"), ("max_consecutive_skips", True, "whole number"),
])
def test_bad_options_are_refused_by_name(field, value, words):
    with pytest.raises(StepCacheError, match=words.replace("(", r"\(")):
        StepCacheOptions.from_mapping({field: value})


def test_unknown_keys_and_a_non_mapping_are_refused():
    with pytest.raises(StepCacheError, match="unknown key.*skip_everything"):
        StepCacheOptions.from_mapping({"skip_everything": True})
    with pytest.raises(StepCacheError, match="use a mapping"):
        StepCacheOptions.from_mapping(["threshold", 1])


def test_a_tuple_answering_model_gets_tuples_on_skipped_steps_too():
    class TupleModel(Settling):
        def forward(self, x, t, *rest):
            return (super().forward(x, t),)

    cached = step_cached(TupleModel(), {"threshold": 1, "start_percent": 0})
    x = torch.randn(1, 4, 8, 8)
    outs = [cached(x + i * 1e-3, torch.tensor([999.0 - 100 * i])) for i in range(6)]
    assert all(isinstance(o, tuple) and len(o) == 1 for o in outs) and cached.report().skipped > 0


def test_the_python_api_is_exported():
    assert kiln.step_cached is step_cached and kiln.StepCacheOptions is StepCacheOptions


def test_keys_called_alike_are_reported_apart():
    cache = StepCache(StepCacheOptions(threshold=0))
    for key in ("uuid-1", "uuid-2"):
        cache.step(torch.ones(1, 2), 0.0, lambda: torch.ones(1, 2), key=key, label="cond")
    assert cache.report().patterns == {"cond": "C", "cond #2": "C"}


def test_a_run_keeps_a_bounded_number_of_conds():
    """Each cond holds latent-sized tensors; a workflow with endless conds gets an error, not the memory."""
    from kiln.compiler.step_cache.decision import MAX_KEYS

    cache = StepCache(StepCacheOptions(threshold=0))
    for key in range(MAX_KEYS):
        cache.step(torch.ones(1, 2), 0.0, lambda: torch.ones(1, 2), key=key)
    with pytest.raises(StepCacheError, match=f"more than {MAX_KEYS} conds"):
        cache.step(torch.ones(1, 2), 0.0, lambda: torch.ones(1, 2), key="one more")


def test_method_forecast_answers_a_skip_with_the_change_extrapolated_in_the_sampler_s_time():
    """Changes 1, 4, 9, 16 at times 1, 2, 3, 4 (out - x = time squared: second order predicted the fourth
    exactly): a skip at time 6 answers x + 36, where reuse would answer x + 16; at uneven times too, since
    the forecast is in `time`, not in steps."""
    cache = StepCache(StepCacheOptions(method="forecast", threshold=10, error_budget=10, start_percent=0.35,
                                       max_consecutive_skips=100))
    for p, t in ((0.0, 1.0), (0.1, 2.0), (0.2, 3.0), (0.3, 4.0)):
        cache.step(torch.full((1, 2), p), p, lambda t=t, p=p: torch.full((1, 2), p + t * t), time=t)
    out = cache.step(torch.full((1, 2), 0.5), 0.4, lambda: torch.zeros(1, 2), time=6.0)
    assert cache.report().patterns["all"] == "CCCCs"
    assert torch.allclose(out, torch.full((1, 2), 0.5 + 36.0))


def test_method_forecast_with_one_computed_step_answers_as_reuse():
    cache = StepCache(StepCacheOptions(method="forecast", threshold=10, error_budget=10, start_percent=0, max_consecutive_skips=100))
    cache.step(torch.ones(1, 2), 0.0, lambda: torch.full((1, 2), 3.0), time=10.0)
    cache._states["all"].rate = 0.0  # the rule has nothing to go on yet with one computed step: skip regardless
    out = cache.step(torch.full((1, 2), 2.0), 0.5, lambda: torch.zeros(1, 2), time=5.0)
    assert torch.equal(out, torch.full((1, 2), 4.0))


def test_a_step_cached_model_forecasts_in_its_timesteps():
    class Quadratic(torch.nn.Module):  # output - input is a quadratic of the timestep
        def forward(self, x, t, *rest):
            return x + (t.reshape(-1, 1) / 100) ** 2

    cached = step_cached(Quadratic(), {"method": "forecast", "threshold": 10, "error_budget": 10, "start_percent": 0.35,
                                      "max_consecutive_skips": 100})
    times = (999.0, 900.0, 800.0, 700.0, 400.0, 300.0, 0.0)
    outs = [cached(torch.full((1, 3), float(i)), torch.tensor([t])) for i, t in enumerate(times)]
    assert cached.report().patterns["all"] == "CCCCssC"
    assert torch.allclose(outs[4], torch.full((1, 3), 4 + 16.0)) and torch.allclose(outs[5], torch.full((1, 3), 5 + 9.0))


def _trajectory(cache, jitter: float, steps: int = 30, seed: int = 0):
    """A synthetic run: inputs settle along a line; the model's change (output - input) is a smooth quadratic
    in the time, plus `jitter` of noise drawn anew at every step (a model that moves more than any rule
    predicts from its last steps). Returns (the answers, the exact outputs)."""
    generator = torch.Generator().manual_seed(seed)
    answers, exact = [], []
    for i in range(steps):
        t = 1.0 - i / (steps - 1)
        x = torch.full((1, 8), 1.0 - 0.5 * i / steps)
        out = x + (0.2 + 0.5 * t + 0.3 * t * t) + jitter * torch.randn(1, 8, generator=generator)
        answers.append(cache.step(x, i / (steps - 1), lambda out=out: out, time=t))
        exact.append(out)
    return answers, exact


def test_calibration_a_model_that_moves_more_than_predicted_computes_more():
    options = StepCacheOptions(method="forecast", threshold=0.05, error_budget=10, max_consecutive_skips=3)
    smooth, wobbly = StepCache(options), StepCache(options)
    _trajectory(smooth, jitter=0.0)
    _trajectory(wobbly, jitter=0.05)
    assert smooth._states["all"].calibrations[2].scale < 0.1 < min(c.scale for c in wobbly._states["all"].calibrations)
    assert wobbly.report().computed > smooth.report().computed + 5, (smooth.report(), wobbly.report())


def test_the_run_s_estimated_error_stays_within_its_budget_and_a_bigger_budget_skips_more():
    skipped, spent = [], []
    for budget in (0.0, 0.05, 0.2, 10.0):
        cache = StepCache(StepCacheOptions(method="reuse", threshold=0.5, error_budget=budget, max_consecutive_skips=3))
        _trajectory(cache, jitter=0.01)
        skipped.append(cache.report().skipped)
        spent.append(cache._budget.spent)
        assert cache._budget.spent <= budget
    assert skipped[0] == 0 and skipped == sorted(skipped) and skipped[1] < skipped[-1]
    assert spent[2] > 0.5 * 0.2  # the run used its budget: the budget, not the threshold, stopped it


def test_a_forecasting_run_keeps_a_bounded_number_of_tensors_per_cond():
    from kiln.compiler.step_cache.forecast import FORECAST_ORDER

    cache = StepCache(StepCacheOptions(method="forecast", threshold=0))
    _trajectory(cache, jitter=0.0, steps=50)
    assert len(cache._states["all"].changes) == FORECAST_ORDER + 1


@pytest.mark.parametrize("value, words", [(-0.1, "error_budget=-0.1: use a number from 0"), (11, "error_budget=11"),
                                          ("1", "error_budget='1': use a number"), (float("inf"), "error_budget=inf")])
def test_a_bad_error_budget_is_refused_by_name(value, words):
    with pytest.raises(StepCacheError, match=words):
        StepCacheOptions.from_mapping({"error_budget": value})


def test_the_report_says_the_estimated_error_spent_beside_the_calls_computed_and_skipped():
    cache = StepCache(StepCacheOptions(method="forecast", threshold=0.5, error_budget=0.3, max_consecutive_skips=3))
    _trajectory(cache, jitter=0.01)
    report = cache.report()
    assert report.skipped > 0 and 0 < report.error_spent <= report.error_budget == 0.3
    assert report.error_spent == cache._budget.spent
    line = report.line()
    assert f"{report.computed} of 30 model calls computed, {report.skipped} skipped" in line
    assert f"estimated error spent {report.error_spent:.3f} of a budget of 0.3" in line
    cache.reset()
    assert cache.last_report.error_spent == report.error_spent and cache.report().error_spent == 0


def test_method_forecast_answers_with_the_order_that_predicted_the_run_s_computed_steps_best():
    """Smooth changes: second order predicts them; jittery ones: extrapolating amplifies the jitter, and
    the lower order wins (a model whose outputs do not follow a curve is answered as reuse would)."""
    from kiln.compiler.step_cache.decision import _best_order

    options = StepCacheOptions(method="forecast", threshold=0.0, error_budget=10)
    smooth, jittery = StepCache(options), StepCache(options)
    _trajectory(smooth, jitter=0.0)
    _trajectory(jittery, jitter=0.05)
    assert _best_order(smooth._states["all"]) == 2 and _best_order(jittery._states["all"]) == 0


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -1, MAX_ERROR_BUDGET + 1, "1", True, None])
def test_a_workflow_s_error_budget_out_of_bounds_or_not_a_number_is_refused_naming_the_field(budget):
    with pytest.raises(StepCacheError, match=r"^step_cache\.error_budget="):
        StepCacheOptions(error_budget=budget)


def test_given_the_run_s_timesteps_the_window_counts_steps_not_the_timestep_s_value():
    # a flow model's shifted sigmas (shift 3): the first steps crowd near sigma 1, so by the timestep's value
    # (1 - sigma) a start_percent of 0.2 is reached only at step 9 of 20; by steps, at step 4
    s = torch.linspace(1, 0, 21)
    sigmas = (3 * s / (1 + 2 * s))[:-1]
    options = {"threshold": 10, "error_budget": 10, "start_percent": 0.2, "end_percent": 0.9,
               "max_consecutive_skips": 100}
    by_value = step_cached(Settling(), options, num_train_timesteps=1)
    by_steps = step_cached(Settling(), options, num_train_timesteps=1, timesteps=sigmas)
    for model in (by_value, by_steps):
        x = torch.ones(1, 4)
        for sigma in sigmas:
            x = model(x, sigma.reshape(1))
    steps, value = by_steps.report().patterns["all"], by_value.report().patterns["all"]
    assert steps.index("s") == 4 and steps.endswith("CC") and len(steps) == 20  # steps 4 to 17 may skip (18 / 20 = 0.9)
    assert value.index("s") == 9
    assert [by_steps.progress(float(t)) for t in sigmas[[0, 4, -1]]] == [0.0, 0.2, 1.0]


@pytest.mark.parametrize("timesteps, words", [([], "1 to 10000"), ([1.0, float("nan")], "non-finite")])
def test_bad_timesteps_are_refused_by_name(timesteps, words):
    with pytest.raises(StepCacheError, match="timesteps") as error:
        step_cached(Settling(), timesteps=timesteps)
    assert words in str(error.value)
