"""The step cache's calibration: how far a method's answers really land from the computed ones, against
what its rule estimated.

A rule estimates the change a skipped step stands for (reuse and forecast: the output/input change
rate times the input's change, added up since the last computed step; first_block: the change of the
first block's residual). Whether that estimate is large or small for a model is unknown until a step
is computed: then the answer the step would have had if skipped (the method's own: the kept change,
or the forecast) is compared with what it computed, and their relative distance divided by the rule's
estimate for that step is one sample of this model's scale. The scale is the geometric mean of the
last sample and the scale before (`CALIBRATION_WEIGHT` each), so one odd step moves it halfway; until
a first sample it is 1 (the rule's estimate as it is). A model that moves more than its rule
predicts gets a scale above 1, and its estimated errors grow with it: it computes more.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

CALIBRATION_WEIGHT = 0.5   # the newest sample's weight in the scale (in log terms)
MAX_SCALE = 1e3            # a sample beyond this (an estimate of nearly 0 beside a real error) is taken as this


@dataclass
class Calibration:
    scale: float = 1.0
    samples: int = 0

    def observe(self, estimate: Optional[float], error: float) -> None:
        """One computed step: the rule's `estimate` for it (None or 0: nothing estimated, nothing learnt)
        and the relative `error` the method's answer would have had."""
        if estimate is None or not estimate > 0 or not math.isfinite(estimate) or not math.isfinite(error):
            return
        sample = min(max(error / estimate, 1.0 / MAX_SCALE), MAX_SCALE)
        if self.samples == 0:
            self.scale = sample
        else:
            self.scale = math.exp((1 - CALIBRATION_WEIGHT) * math.log(self.scale) + CALIBRATION_WEIGHT * math.log(sample))
        self.samples += 1

    def error(self, estimate: float) -> float:
        """The estimated relative error of an answer whose rule estimated `estimate`."""
        return self.scale * estimate
