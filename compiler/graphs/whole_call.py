"""The whole model call replayed as one CUDA graph: `WholeCallGraphs`.

On a CUDA device a step of a model compiled by blocks costs its Python (the glue between blocks, the
regions kept eager, a TorchDynamo entry per region call) unless the whole call is replayed. Each
call goes through `WholeCallGraphs(run, args, kwargs)`, where `run` is the same call without graphs:

1. the graph-safety rules (compiler/graphs/graph_safety.py; those of the weights asked again only
   when the weights' addresses move): a call they object to runs `run`, and the fallback is said
   once (log and the model's warnings; transient ones, at info level only);
2. its recording key (compiler/graphs/recording_key.py); the key without weights is the call's place;
3. a place is recorded only once things settle: its first call runs `run`, and only a call that
   compiled nothing and changed no region's choice (`marker()` unchanged) lets the next call record;
4. the recording (a Recorder: compiler/graphs/recorder.py); a failed or aborted capture sends the
   place to `run` for good, said with the reason;
5. a replay copies the call's tensors in and returns clones of the outputs (valid after the next
   call); a place whose weights moved (a LoRA, a model swap, a host re-patching weights) is
   re-captured in place, never recompiled: the compiled code is the same, only the addresses differ;
6. the first replay on inputs other than the recorded ones is checked against `run` by the fidelity
   guard (compiler/graphs/fidelity_guard.py); a failed check sends the place to `run` for good.

Recordings are bounded by `limit` places (`shapes.max_cuda_graphs`); a new place beyond it runs `run`
(BUDGET_FULL). `report` holds what happened: recordings, re-captures, replays, capture times, the
recordings' memory and every fallback with its count.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch

from ..host_inputs import host_inputs
from ..torch_compat import module_calls
from .fidelity_guard import FidelityGuard, tf32_in_use
from .graph_safety import RULES, WEIGHT_RULES, CallFacts, GraphFallback, GraphVerdict, call_device, call_verdict
from .recorder import CaptureAborted, Recorder, Recording, Run
from .recording_key import RecordingKey, Unkeyable, recording_key, weight_addresses

log = logging.getLogger("kiln")

CALL_RULES = tuple(rule for rule in RULES if rule not in WEIGHT_RULES)  # asked on every call
TRANSIENT = (GraphFallback.LOWERING_PENDING, GraphFallback.UNSETTLED)  # lifted by a later call: said at info level


@dataclass
class GraphsReport:
    recordings: int = 0           # captures made (re-captures included)
    recaptures: int = 0           # captures made again because the weights moved
    replays: int = 0
    capture_seconds: list = field(default_factory=list)
    nbytes: int = 0               # device memory the live recordings hold
    fallbacks: dict = field(default_factory=dict)  # message -> calls that ran without graphs for it

    def line(self) -> str:
        seconds = f", last capture {self.capture_seconds[-1]:.2f} s" if self.capture_seconds else ""
        without = sum(self.fallbacks.values())
        return (f"whole-call CUDA graphs: {self.recordings} recording(s) ({self.recaptures} re-captured for new "
                f"weights){seconds}, {self.replays} replay(s), {self.nbytes / 2**20:.1f} MiB held, "
                f"{without} call(s) without graphs")


@dataclass
class _Place:
    """One recording key without its weights: its recording, once settled and made."""

    index: int
    settled: bool = False
    recording: Optional[Recording] = None
    key: Optional[RecordingKey] = None
    checked: bool = False
    refused: Optional[GraphVerdict] = None


class WholeCallGraphs:
    def __init__(self, module: torch.nn.Module, recorder: Recorder, limit: int, compiles: Callable[[], int],
                 marker: Optional[Callable[[], Hashable]] = None,
                 lowering_pending: Callable[[], list] = list,
                 guard: Optional[FidelityGuard] = None,
                 warn: Callable[[str], bool] = lambda note: True, label: str = "model",
                 record_on: tuple[str, ...] = ("cuda",)):
        self.module = module
        self.recorder = recorder
        self.limit = limit
        self.compiles = compiles
        self.marker = marker or compiles
        self.lowering_pending = lowering_pending
        self.guard = guard if guard is not None else FidelityGuard()
        self.warn = warn           # keeps a note among the model's warnings; True the first time
        self.label = label
        self.record_on = record_on  # device types recorded: CUDA (a FakeRecorder's tests add "cpu")
        self.report = GraphsReport()
        self._places: dict[RecordingKey, _Place] = {}
        self._said: set[str] = set()
        self._weights_seen: Optional[tuple] = None
        self._weights_verdict: GraphVerdict = GraphVerdict()

    def __call__(self, run: Run, args: tuple, kwargs: dict) -> Any:
        host = host_inputs()
        device = call_device(args, kwargs)
        facts = CallFacts(self.module, args, kwargs, host, device, self.lowering_pending, self.record_on)
        verdict = call_verdict(facts, CALL_RULES)
        if verdict.replays:
            weights = weight_addresses(self.module)
            if weights != self._weights_seen:  # the weights moved (or first call): ask their rules again
                self._weights_seen, self._weights_verdict = weights, call_verdict(facts, WEIGHT_RULES)
            verdict = self._weights_verdict
        if not verdict.replays:
            return self._without(verdict, run, args, kwargs)
        try:
            key = recording_key(self.module, args, kwargs, host, weights)
        except Unkeyable as exc:
            return self._without(GraphVerdict(GraphFallback.UNKEYED_INPUT, str(exc)), run, args, kwargs)
        place = self._places.get(key.shape)
        if place is None:
            if self._held() >= self.limit:
                return self._without(GraphVerdict(GraphFallback.BUDGET_FULL, f"{self.limit} held"), run, args, kwargs)
            place = self._places[key.shape] = _Place(len(self._places) + 1)
        if place.refused is not None:
            return self._without(place.refused, run, args, kwargs)
        if not place.settled:
            return self._settling(place, run, args, kwargs)
        if place.recording is None or place.key.weights != key.weights:
            return self._record(place, key, run, args, kwargs, device)
        return self._replay(place, run, args, kwargs, device)

    # ---- the steps ----------------------------------------------------------------------------

    def _settling(self, place: _Place, run: Run, args: tuple, kwargs: dict) -> Any:
        before = self.marker()
        out = run(args, kwargs)
        place.settled = self.marker() == before
        if not place.settled:
            self._count(GraphVerdict(GraphFallback.UNSETTLED))
        return out

    def _record(self, place: _Place, key: RecordingKey, run: Run, args: tuple, kwargs: dict, device: str) -> Any:
        again = place.recording is not None
        if again:
            self.report.nbytes -= place.recording.nbytes
            place.recording = None  # its memory goes back to the pool before the new capture
        start = time.perf_counter()
        try:
            recording = self.recorder.record(run, args, kwargs, host_inputs(), self.compiles)
        except CaptureAborted as exc:
            return self._refuse(place, GraphVerdict(GraphFallback.CAPTURE_RECOMPILED, str(exc)), run, args, kwargs)
        except Exception as exc:  # noqa: BLE001  a host sync, an op CUDA graphs cannot hold: said, never fatal
            detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            log.debug("Kiln: %s: capture failed", self.label, exc_info=exc)
            return self._refuse(place, GraphVerdict(GraphFallback.CAPTURE_FAILED, detail), run, args, kwargs)
        seconds = time.perf_counter() - start
        place.recording, place.key, place.checked = recording, key, False
        report = self.report
        report.recordings += 1
        report.recaptures += again
        report.capture_seconds.append(seconds)
        report.nbytes += recording.nbytes
        log.info("Kiln: %s: %s call %d (%s) in %.2f s, %.1f MiB", self.label, "re-recorded for new weights:" if again
                 else "recorded", place.index, key.line(), seconds, recording.nbytes / 2**20)
        out = _owned(recording.replay(args, kwargs))  # on the recorded inputs: the guard waits for the next call
        report.replays += 1
        return out

    def _replay(self, place: _Place, run: Run, args: tuple, kwargs: dict, device: str) -> Any:
        out = _owned(place.recording.replay(args, kwargs))
        self.report.replays += 1
        if place.checked:
            return out
        place.checked = True
        reference: list = []

        def without_graphs():
            reference.append(run(args, kwargs))
            return reference[0]

        comparison = self.guard.check_once(("recording", place.index, place.key.weights),
                                           f"recording {place.index} ({place.key.line()})", out, without_graphs,
                                           tf32_in_use(device))
        if comparison is None or comparison.passed:
            return out
        self.report.nbytes -= place.recording.nbytes
        place.recording = None
        return self._refuse(place, GraphVerdict(GraphFallback.GUARD_FAILED, comparison.line()), None, args, kwargs,
                            reference[0])

    # ---- without graphs -----------------------------------------------------------------------

    def _refuse(self, place: _Place, verdict: GraphVerdict, run: Optional[Run], args: tuple, kwargs: dict,
                out: Any = None) -> Any:
        place.refused = verdict
        place.recording = None
        if run is None:
            self._count(verdict)
            return out
        return self._without(verdict, run, args, kwargs)

    def _without(self, verdict: GraphVerdict, run: Run, args: tuple, kwargs: dict) -> Any:
        self._count(verdict)
        return run(args, kwargs)

    def _count(self, verdict: GraphVerdict) -> None:
        if verdict.fallback.quiet:
            return
        message = verdict.message()
        self.report.fallbacks[message] = self.report.fallbacks.get(message, 0) + 1
        if message in self._said:
            return
        self._said.add(message)
        if verdict.fallback in TRANSIENT:
            log.info("Kiln: %s %s", self.label, message)
        elif self.warn(message):
            log.warning("Kiln: %s %s", self.label, message)

    def _held(self) -> int:
        return sum(place.refused is None for place in self._places.values())


def _owned(outputs: Any) -> Any:
    """The replay's outputs as the caller's own tensors: the next replay overwrites the recording's."""
    return module_calls.map_tensors(torch.clone, outputs)


__all__ = ["WholeCallGraphs", "GraphsReport", "TRANSIENT"]
