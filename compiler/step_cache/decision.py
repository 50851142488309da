"""The step cache: skip the model evaluations of a sampling run that would change almost nothing.

Late in sampling, consecutive denoising steps change the model's output little. With method
`reuse` (EasyCache's rule), each computed step keeps the model's change of its input, `output - x`,
and the rate at which the output moved against the input since the step computed before it. A step
whose input moved by `d` is estimated to move the output by `rate * d`, relative to the output's
size; while these estimates, added up since the last computed step, stay under `threshold`, the
step is skipped and answered with `x + the kept change`. The first steps (`start_percent` of the
run) and the last (`end_percent` on) always compute, and so does any step after
`max_consecutive_skips` skips.

State belongs to one sampling run (`StepCache.reset()`, or a new run detected: progress going
back), never to the model: a new resolution, batch, step count or sampler starts fresh, and a key
whose input changes shape within a run starts afresh. Within a run it is kept per key (ComfyUI's
conds, which a sampler may evaluate in separate calls): the first key seen at a step decides for the step, and every key follows that decision
when it has a change of its own to reuse. The decision is made outside the model, so compiled
graphs never see it: changing the threshold or the step count recompiles nothing.

With method `first_block` (First Block Cache's rule), every step runs the model's first block
(compiler/step_cache/first_block_probe.py observes it) and compares its residual, output minus input, with the
one of the last computed step: while their mean absolute difference, relative to that residual's
size, stays under `threshold`, the rest of the model is skipped (the call ends at the first block)
and the step is answered as above. It measures inside the model where `reuse` estimates from the
input, at the price of the first block on every skipped step.

With method `forecast`, steps are decided as with `reuse`, but a skipped step answers with the
change extrapolated from the last computed steps in the sampler's own time (the sigma or timestep
the model is called with): TaylorSeer's forecast, second order where three computed steps exist
(compiler/step_cache/forecast.py). Each key keeps the changes of its last FORECAST_ORDER + 1
computed steps.

Every method's estimate is calibrated at the run's computed steps and its total bounded by an error
budget. At a computed step the answer it would have had if skipped (the kept or forecast change) is
compared with what it computed; their relative distance over the rule's estimate for that step
scales the rule's later estimates (compiler/step_cache/calibration.py, per key): a model whose
output moves more than its rule predicts gets larger estimated errors and computes more. For reuse
and forecast the threshold bounds that calibrated estimate; for first_block it bounds the measured
change of the first block's residual, as before. Each skip spends its calibrated estimate from the
run's `error_budget` (compiler/step_cache/error_budget.py); once spent, every step computes.

`StepCache.step(x, progress, compute, key, time=...)` is the whole interface: `compute()` runs the model
(inside `first_block_probed(cache, block)` for method first_block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Hashable, Mapping, Optional

import torch

from ...choices import (DEFAULT_STEP_CACHE_METHOD, MAX_ERROR_BUDGET, METHOD_THRESHOLD, STEP_CACHE_METHODS, STEP_CACHE_SETTINGS,
                        STEP_CACHE_THRESHOLDS)
from ..options.option_text import check_keys, shorten
from .calibration import Calibration
from .error_budget import ErrorBudget
from .forecast import FORECAST_ORDER, forecast

MAX_KEYS = 64  # conds kept per run, each holding at most 3 + FORECAST_ORDER + 1 latent-sized tensors: a workflow
               # cannot ask for more, nor for more per cond (no option sets how many changes a key keeps)


class StepCacheError(ValueError):
    """A step cache option is invalid, or the cache was used wrongly; the message names the field."""


class _SkipRest(Exception):
    """Raised by `StepCache.probe` to end a model call after its first block: the step is skipped."""


@dataclass(frozen=True)
class StepCacheOptions:
    method: str = DEFAULT_STEP_CACHE_METHOD
    # what each means and why its default: choices.STEP_CACHE_SETTINGS (the node's widgets read it too)
    threshold: Optional[float] = None  # None (or -1): the method's default, choices.STEP_CACHE_THRESHOLDS
    start_percent: float = STEP_CACHE_SETTINGS["start_percent"][0]
    end_percent: float = STEP_CACHE_SETTINGS["end_percent"][0]
    max_consecutive_skips: int = STEP_CACHE_SETTINGS["max_consecutive_skips"][0]
    error_budget: float = STEP_CACHE_SETTINGS["error_budget"][0]

    def __post_init__(self):
        if self.method not in STEP_CACHE_METHODS:
            raise StepCacheError(f"step_cache.method={shorten(self.method)}: use one of {', '.join(STEP_CACHE_METHODS)}")
        if self.threshold is None or (type(self.threshold) in (int, float) and self.threshold == METHOD_THRESHOLD):
            object.__setattr__(self, "threshold", STEP_CACHE_THRESHOLDS[self.method])
        for name in ("threshold", "start_percent", "end_percent", "error_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise StepCacheError(f"step_cache.{name}={shorten(value)}: use a number")
        if not 0 <= self.threshold <= 10:
            raise StepCacheError(f"step_cache.threshold={shorten(self.threshold)}: use a number from 0 (never skip) "
                                 f"to 10, or {METHOD_THRESHOLD:g} for the method's default")
        if not 0 <= self.error_budget <= MAX_ERROR_BUDGET:
            raise StepCacheError(f"step_cache.error_budget={shorten(self.error_budget)}: use a number from 0 (never "
                                 f"skip) to {MAX_ERROR_BUDGET:g}")
        if not 0 <= self.start_percent <= self.end_percent <= 1:
            raise StepCacheError(f"step_cache.start_percent={shorten(self.start_percent)}, end_percent="
                                 f"{shorten(self.end_percent)}: use 0 <= start_percent <= end_percent <= 1")
        skips = self.max_consecutive_skips
        if isinstance(skips, bool) or not isinstance(skips, int) or not 0 <= skips <= 100:
            raise StepCacheError(f"step_cache.max_consecutive_skips={shorten(skips)}: use a whole number from 0 to 100")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "StepCacheOptions":
        """From a node's or a YAML's mapping: unknown keys are refused by name."""
        if not isinstance(values, Mapping):
            raise StepCacheError(f"step_cache: use a mapping of {', '.join(f.name for f in fields(cls))}, "
                                 f"not {shorten(values)}")
        check_keys(values, [f.name for f in fields(cls)], "step_cache", StepCacheError)
        return cls(**values)


@dataclass
class StepCacheReport:
    """What one sampling run did: a letter per model call (C computed, s skipped), per key."""

    threshold: float
    patterns: dict[str, str] = field(default_factory=dict)   # key -> "CCCCsCs..."
    estimate_used: float = 0.0     # the largest estimate a skip was taken at, of `threshold`
    error_spent: float = 0.0       # the estimated error the run's skips spent (each skip's, calibrated, added up) ...
    error_budget: float = math.inf  # ... of this budget

    @property
    def computed(self) -> int:
        return sum(p.count("C") for p in self.patterns.values())

    @property
    def skipped(self) -> int:
        return sum(p.count("s") for p in self.patterns.values())

    def line(self) -> str:
        calls = self.computed + self.skipped
        if not calls:
            return "step cache: no model call yet"
        saved = f"{calls / self.computed:.2f}x fewer model evaluations" if self.computed else "every call skipped"
        keys = "; ".join(f"{key}: {pattern}" for key, pattern in self.patterns.items())
        return (f"step cache: {self.computed} of {calls} model calls computed, {self.skipped} skipped ({saved}); "
                f"estimated error spent {self.error_spent:.3f} of a budget of {self.error_budget:g}; "
                f"largest estimate skipped at {self.estimate_used:.3f} of the threshold {self.threshold:g}; {keys}")


@dataclass
class _KeyState:
    x_last: Optional[torch.Tensor] = None       # the input of the step before
    out_last: Optional[torch.Tensor] = None     # the output of the last computed step
    x_computed: Optional[torch.Tensor] = None   # its input: a skip reuses out_last - x_computed
    rate: Optional[float] = None                # output change / input change between the last two computed steps
    changes: list = field(default_factory=list)  # forecast: (time, output - input) of the last computed steps, oldest first
    probe_computed: Optional[torch.Tensor] = None  # first_block: the first block's residual at the last computed step
    probe_now: Optional[torch.Tensor] = None    # ... and at the step being computed
    estimate: Optional[float] = None            # the rule's estimate for the step in progress, calibrated if it computes
    calibrations: list = field(default_factory=lambda: [Calibration()])  # one per forecast order (0: reuse's answer)
    pattern: list = field(default_factory=list)
    label: str = ""                             # what the report calls this key


def _best_order(state: _KeyState) -> int:
    """The order whose answers came closest to the computed steps so far, relative to the rule's estimates
    (the lowest calibrated scale; the lower order on a tie, order 0 before any sample)."""
    sampled = [i for i, c in enumerate(state.calibrations) if c.samples]
    return min(sampled, key=lambda i: (state.calibrations[i].scale, i)) if sampled else 0


def _mean_abs(t: torch.Tensor) -> float:
    return t.detach().float().abs().mean().item()


class StepCache:
    """The state of one sampling run; see the module docstring."""

    def __init__(self, options: Optional[StepCacheOptions] = None):
        self.options = options or StepCacheOptions()
        self._states: dict[Hashable, _KeyState] = {}
        self.reset()

    def reset(self) -> None:
        """A new sampling run: nothing is kept from the last one (its report stays in `last_report`)."""
        self.last_report = self.report() if self._states else None
        self._states = {}
        self._progress: Optional[float] = None
        self._skip_step: Optional[bool] = None   # the decision of the step in progress (its first key's)
        self._added = 0.0                         # estimates added up since the last computed step
        self._skips = 0                           # consecutive skipped steps
        self._estimate_used = 0.0
        self._budget = ErrorBudget(self.options.error_budget)
        self._probing: Optional[tuple[_KeyState, bool]] = None  # first_block: (key state, may skip) during compute()

    def report(self) -> StepCacheReport:
        patterns: dict[str, str] = {}
        for key, state in self._states.items():
            name = state.label or str(key)
            if name in patterns:  # two keys the caller calls alike (two positive conds): both shown
                name = f"{name} #{sum(1 for n in patterns if n.split(' #')[0] == name) + 1}"
            patterns[name] = "".join(state.pattern)
        return StepCacheReport(threshold=self.options.threshold, estimate_used=self._estimate_used, patterns=patterns,
                               error_spent=self._budget.spent, error_budget=self._budget.budget)

    def step(self, x: torch.Tensor, progress: float, compute: Callable[[], torch.Tensor],
             key: Hashable = "all", label: str = "", time: Optional[float] = None) -> torch.Tensor:
        """The model's output for input `x` at `progress` (0 at the run's first step, 1 at its end):
        `compute()`'s, or `x` plus the change kept from the last computed step (method forecast: the
        change extrapolated to `time`, the sigma or timestep the model is called with; default
        `progress`). `key` tells conds apart; `label` is what the report calls it (default: the key).
        With method first_block, `compute()` must pass the model's first block's residual to `probe()`
        as it runs (`first_block_probed` arranges that)."""
        if not isinstance(progress, (int, float)) or not math.isfinite(progress):
            raise StepCacheError(f"step cache: progress={shorten(progress)} must be a finite number")
        time = progress if time is None else time
        if not isinstance(time, (int, float)) or not math.isfinite(time):
            raise StepCacheError(f"step cache: time={shorten(time)} must be a finite number")
        if self._progress is not None and progress < self._progress:
            self.reset()  # progress went back: a new sampling run
        if progress != self._progress:
            self._progress, self._skip_step = progress, None
        state = self._states.get(key)
        if state is None:
            if len(self._states) >= MAX_KEYS:
                raise StepCacheError(f"step cache: more than {MAX_KEYS} conds in one sampling run")
            state = self._states[key] = self._new_state([], label)
        elif state.x_last is not None and (state.x_last.shape, state.x_last.dtype) != (x.shape, x.dtype):
            state = self._states[key] = self._new_state(state.pattern, label)  # a new size: nothing kept applies
        deciding = self._skip_step is None  # the first key of this step decides for every key
        if deciding and self.options.method != "first_block":
            self._skip_step = self._decide(state, x, progress)
        if self._skip_step and state.out_last is not None:  # a key with nothing computed yet computes
            return self._reuse(state, x, time)
        if self.options.method == "first_block":
            try:
                out = self._computed_with_probe(state, compute, may_skip=deciding and self._may_skip(state, progress))
            except _SkipRest:
                self._skip_step = True
                self._skips += 1
                return self._reuse(state, x, time)
            if deciding:
                self._skip_step, self._skips = False, 0
        else:
            out = compute()
        self._learn(state, x, out, time)
        state.pattern.append("C")
        return out

    @property
    def probing(self) -> bool:
        """Whether a model call in progress waits for its first block's residual (method first_block)."""
        return self._probing is not None

    def probe(self, residual: torch.Tensor) -> None:
        """method first_block: the first block's residual (its output - its input) of the model call in
        progress. Ends the call (by raising, for `step` to catch) when the step is skipped; a call of the
        first block outside `step`, or a second one within a call, is ignored."""
        if self._probing is None:
            return
        state, may_skip = self._probing
        self._probing = None
        residual = residual.detach()
        kept = state.probe_computed
        if kept is not None and kept.shape == residual.shape:
            size = _mean_abs(kept)
            change = _mean_abs(residual - kept) / size if size > 0 else math.inf
            state.estimate = change
            error = state.calibrations[0].error(change)
            if may_skip and change < self.options.threshold and self._budget.fits(error):
                self._estimate_used = max(self._estimate_used, change)  # first_block's threshold bounds its measure
                self._budget.spend(error)
                state.estimate = None
                raise _SkipRest()
        state.probe_now = residual

    def _computed_with_probe(self, state: _KeyState, compute: Callable[[], torch.Tensor], may_skip: bool) -> torch.Tensor:
        self._probing = (state, may_skip)
        state.probe_now = state.estimate = None
        try:
            out = compute()
        finally:
            unprobed, self._probing = self._probing is not None, None
        if unprobed:
            raise StepCacheError("step cache: method first_block, but the model ran without its first block reporting "
                                 "to the cache: a model compiled whole (Kiln's compile_unit whole, core's compile "
                                 "node) runs its blocks inside one graph; compile it by blocks (Kiln's default), run "
                                 "it eagerly, or use method reuse")
        state.probe_computed = state.probe_now
        return out

    def _new_state(self, pattern: list, label: str) -> _KeyState:
        orders = FORECAST_ORDER + 1 if self.options.method == "forecast" else 1
        return _KeyState(pattern=pattern, label=label, calibrations=[Calibration() for _ in range(orders)])

    def _reuse(self, state: _KeyState, x: torch.Tensor, time: float) -> torch.Tensor:
        state.pattern.append("s")
        state.x_last = x
        return x + self._answer_change(state, time).to(x.dtype)

    def _answer_change(self, state: _KeyState, time: float, order: Optional[int] = None) -> torch.Tensor:
        """The change (output - input) a skipped step at `time` answers with: the last computed step's
        (reuse, first_block), or the change forecast from the last computed steps (forecast) at `order`,
        by default the order that has predicted this run's computed steps best so far."""
        order = _best_order(state) if order is None else order
        if self.options.method == "forecast" and state.changes and order > 0:
            return forecast([t for t, _ in state.changes], [c for _, c in state.changes], time, order=order)
        return state.out_last - state.x_computed

    def _may_skip(self, state: _KeyState, progress: float) -> bool:
        """Whether the settings let this step skip at all (inside the window, under the skips in a row,
        something computed to reuse); the method decides whether it does."""
        options = self.options
        return (options.threshold > 0 and options.start_percent <= progress < options.end_percent
                and self._skips < options.max_consecutive_skips and state.out_last is not None)

    def _decide(self, state: _KeyState, x: torch.Tensor, progress: float) -> bool:
        """methods reuse and forecast: skip this step? Adds this step's estimate to those since the last
        computed step; skips while the calibrated estimate stays under the threshold and fits in the run's
        error budget (spending it), or starts counting afresh when it computes."""
        skip = False
        state.estimate = None
        if state.rate is not None and state.x_last is not None:
            size = _mean_abs(state.out_last)
            state.estimate = self._added + (state.rate * _mean_abs(x - state.x_last) / size if size > 0 else math.inf)
        if state.estimate is not None and self._may_skip(state, progress):
            error = state.calibrations[_best_order(state)].error(state.estimate)
            if error < self.options.threshold and self._budget.fits(error):
                self._added = state.estimate
                self._budget.spend(error)
                self._estimate_used = max(self._estimate_used, error)
                skip = True
        if skip:
            self._skips += 1
        else:
            self._added, self._skips = 0.0, 0
        return skip

    def _learn(self, state: _KeyState, x: torch.Tensor, out: torch.Tensor, time: float) -> None:
        """After a computed step: the change to reuse (forecast: the last FORECAST_ORDER + 1 of them,
        at most, per key), and the output/input change rate."""
        if state.out_last is not None and state.estimate is not None:  # calibrate: the answers it would have had
            size = _mean_abs(out)
            for order, calibration in enumerate(state.calibrations):
                answer = x + self._answer_change(state, time, order).to(x.dtype)
                calibration.observe(state.estimate, _mean_abs(answer - out) / size if size > 0 else math.inf)
        state.estimate = None
        if state.out_last is not None:
            moved = _mean_abs(x - state.x_computed)
            state.rate = _mean_abs(out - state.out_last) / moved if moved > 0 else None
        state.out_last, state.x_computed, state.x_last = out.detach(), x.detach(), x.detach()
        if self.options.method == "forecast":
            state.changes = [*state.changes[-FORECAST_ORDER:], (time, (out - x).detach())]
