"""The step cache's error budget: how much estimated error one sampling run may spend on skipped steps.

A threshold bounds each skip; the budget bounds their sum over a run, so a long run, or a model whose
calibrated errors are large (compiler/step_cache/calibration.py), stops skipping once it has spent
`budget` and computes every step after. Each skipped step spends its own estimated relative error
(the calibrated estimate of how far its answer lies from the output it stands for); a budget of 0
never skips.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ErrorBudget:
    budget: float
    spent: float = 0.0

    def fits(self, error: float) -> bool:
        """Whether a skip whose answer is estimated `error` off still fits in what is left."""
        return self.budget > 0 and error >= 0 and self.spent + error <= self.budget

    def spend(self, error: float) -> None:
        self.spent += error
