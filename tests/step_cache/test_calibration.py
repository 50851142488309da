"""The step cache's calibration (compiler/step_cache/calibration.py): the scale between a rule's estimates
and the errors its answers really had."""
import math

from kiln.compiler.step_cache.calibration import CALIBRATION_WEIGHT, MAX_SCALE, Calibration


def test_uncalibrated_the_estimate_stands_as_it_is():
    assert Calibration().error(0.04) == 0.04


def test_the_first_sample_sets_the_scale_and_later_ones_move_it_by_their_weight():
    calibration = Calibration()
    calibration.observe(estimate=0.1, error=0.3)
    assert math.isclose(calibration.scale, 3.0) and math.isclose(calibration.error(0.02), 0.06)
    calibration.observe(estimate=0.1, error=0.0)      # a perfect answer: the scale drops, bounded below
    calibration.observe(estimate=0.2, error=0.05)
    assert CALIBRATION_WEIGHT == 0.5
    expected = math.exp(0.5 * (0.5 * math.log(3.0) + 0.5 * math.log(1 / MAX_SCALE)) + 0.5 * math.log(0.25))
    assert math.isclose(calibration.scale, expected) and calibration.samples == 3


def test_steps_without_an_estimate_teach_nothing_and_a_huge_sample_is_bounded():
    calibration = Calibration()
    for estimate, error in ((None, 1.0), (0.0, 1.0), (float("inf"), 1.0), (0.1, float("nan"))):
        calibration.observe(estimate, error)
    assert calibration.scale == 1.0 and calibration.samples == 0
    calibration.observe(1e-12, 5.0)
    assert calibration.scale == MAX_SCALE
