"""The step cache's forecast (compiler/step_cache/forecast.py): exact on polynomials of its order, at
any spacing, and of lower order where fewer computed steps exist."""
import pytest
import torch

from kiln.compiler.step_cache.forecast import FORECAST_ORDER, forecast


def _values(poly, times):
    base = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    return [base * poly(t) for t in times], base


@pytest.mark.parametrize("times", [(999.0, 966.0, 932.0), (14.6, 9.7, 4.1), (1.0, 0.55, 0.5)])  # even and uneven
def test_second_order_is_exact_on_a_quadratic_at_even_and_uneven_spacing(times):
    poly = lambda t: 3.0 - 0.2 * t + 0.01 * t * t  # noqa: E731
    values, base = _values(poly, times)
    at = times[-1] - 0.7 * (times[0] - times[-1])
    assert torch.allclose(forecast(times, values, at), base * poly(at), rtol=1e-9, atol=1e-9)


def test_first_order_is_exact_on_a_line_and_misses_a_quadratic():
    times = (10.0, 7.0, 3.0)
    line, base = _values(lambda t: 2.0 - 0.5 * t, times)
    assert torch.allclose(forecast(times, line, 0.0, order=1), base * 2.0)
    quad, _ = _values(lambda t: t * t, times)
    assert not torch.allclose(forecast(times, quad, 0.0, order=1), base * 0.0)
    assert torch.allclose(forecast(times, quad, 0.0, order=2), base * 0.0, atol=1e-12)


def test_fewer_points_fall_to_a_lower_order():
    values, base = _values(lambda t: 1.0 + t, (5.0, 2.0))
    assert torch.allclose(forecast((5.0, 2.0), values, 0.0), base * 1.0)        # two points: a line
    assert torch.equal(forecast((2.0,), values[1:], 0.0), values[1])              # one point: itself (reuse)


def test_only_the_newest_points_count_and_a_repeated_time_counts_once():
    times = (100.0, 8.0, 6.0, 4.0)                      # the oldest is off the quadratic: it must not count
    values, base = _values(lambda t: t * t, times)
    values[0] = values[0] * 0 + 1e6
    assert FORECAST_ORDER == 2
    assert torch.allclose(forecast(times, values, 0.0), base * 0.0, atol=1e-9)
    twice = forecast((6.0, 4.0, 4.0), [values[2], values[3] * 0, values[3]], 2.0)  # (4, newest) replaces (4, 0)
    assert torch.allclose(twice, base * -4.0, atol=1e-9)  # the line through (6, 36) and (4, 16), at 2


def test_the_answer_keeps_the_values_dtype_and_bad_calls_are_refused():
    values = [torch.ones(2, dtype=torch.float16) * v for v in (1.0, 2.0, 3.0)]
    assert forecast((3.0, 2.0, 1.0), values, 0.0).dtype == torch.float16
    with pytest.raises(ValueError, match="one time per value"):
        forecast((1.0,), [], 0.0)
    with pytest.raises(ValueError, match="order"):
        forecast((1.0,), values[:1], 0.0, order=-1)
