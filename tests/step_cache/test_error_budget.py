"""The step cache's error budget (compiler/step_cache/error_budget.py): what a run may spend on skips."""
from kiln.compiler.step_cache.error_budget import ErrorBudget


def test_a_skip_fits_while_the_run_has_not_spent_its_budget():
    budget = ErrorBudget(0.1)
    assert budget.fits(0.06)
    budget.spend(0.06)
    assert budget.fits(0.04) and not budget.fits(0.05) and not budget.fits(-0.01)
    budget.spend(0.04)
    assert budget.spent == 0.1 and not budget.fits(0.001)


def test_a_budget_of_zero_never_skips():
    assert not ErrorBudget(0.0).fits(0.0)
