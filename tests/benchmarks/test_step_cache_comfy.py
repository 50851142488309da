"""benchmarks/step_cache_comfy.py without ComfyUI: how it finds the threshold at which another cache computes the
calls Kiln's default computed (tests/comfyui/test_comfy_step_cache_bench.py runs it in ComfyUI)."""
import math

from kiln.benchmarks import step_cache_comfy as bench


class Steps:
    """A stand-in for a model's runs: a cache whose threshold t computes `calls(t)` model calls."""

    def __init__(self, calls):
        self.calls, self.tried = calls, []

    def run(self, threshold):
        self.tried.append(threshold)
        return {"calls": self.calls(threshold)}


def test_the_bracket_holds_the_target_between_its_sides():
    runs = Steps(lambda t: max(8.0, 20.0 - math.floor(t * 40) / 4))     # falls in quarter-call steps from 20 to 8
    found = bench.matched(runs, lambda t: t, 12.1, limit=3.0)
    assert found["under"]["calls"] <= 12.1 <= found["over"]["calls"]
    assert found["over"]["threshold"] < found["under"]["threshold"]
    doublings = math.ceil(math.log2(3.0 / bench.MATCH_FIRST))          # from the first threshold tried up to the limit
    assert len(runs.tried) <= 1 + doublings + bench.MATCH_ROUNDS    # the bracket found, then halved


def test_a_threshold_at_the_target_is_one_row_and_out_of_reach_is_said():
    exact = bench.matched(Steps(lambda t: 10.0 if t >= 0.05 else 20.0), lambda t: t, 10.0, limit=3.0)
    assert exact["under"] is exact["over"] and exact["over"]["calls"] == 10.0
    never = bench.matched(Steps(lambda t: 15.0), lambda t: t, 14.0, limit=10.0)
    assert never["under"] is None and never["over"]["threshold"] == 10.0
