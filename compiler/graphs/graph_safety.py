"""Whether a whole model call may be recorded and replayed, and if not, why: `GraphFallback`.

A replay runs none of the call's Python. It is safe only where that Python would have done the
same thing every time, with the same memory. `call_verdict` asks the rules in RULES, in order; the
first that objects gives the call's fallback, a `GraphFallback` with the detail that names what
(the patch, the region, the weight). The call then runs the same compiled code without graphs, and
the log and the model's stats say so, once per fallback and detail. On a device other than CUDA
there are no graphs to replay: that fallback (NOT_CUDA) is never said.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..host_inputs import HostInputs
from ..torch_compat import module_calls


class GraphFallback(enum.Enum):
    """Why a call runs without whole-call CUDA graphs. Each value is the message's start; the detail follows."""

    NOT_CUDA = "the model runs on a device other than CUDA"
    UNSAFE_PATCH = "the call holds patches or wrappers that are not graph-safe (they keep Python state or read the GPU mid-call)"
    OBSERVED_MID_CALL = ("a callback observes a block mid-call (the step cache's method first_block decides there); "
                         "use its method reuse for whole-call graphs")
    LOWERING_PENDING = "regions are still being lowered in the background"
    UNSETTLED = "the last call still compiled or changed a region's choice; recorded once a call changes nothing"
    WEIGHTS_OFF_DEVICE = "some weights are not on the model's device (partially loaded)"
    WEIGHTS_STREAMED = "the host streams or patches the weights per call"
    UNKEYED_INPUT = "the call has an argument a recording cannot key"
    BUDGET_FULL = "this model already holds shapes.max_cuda_graphs recordings (raise it to record more)"
    CAPTURE_FAILED = "recording the call failed"
    CAPTURE_RECOMPILED = "the call kept compiling while it was being recorded"
    GUARD_FAILED = "the recording's first replay on new inputs differed from the call without graphs"

    @property
    def quiet(self) -> bool:
        """Said nowhere: there is nothing the user could want instead."""
        return self is GraphFallback.NOT_CUDA


@dataclass(frozen=True)
class GraphVerdict:
    fallback: Optional[GraphFallback] = None
    detail: str = ""

    @property
    def replays(self) -> bool:
        return self.fallback is None

    def message(self) -> str:
        if self.fallback is None:
            return "the whole call is replayed as a CUDA graph"
        detail = f": {self.detail}" if self.detail else ""
        return f"runs without CUDA graphs: {self.fallback.value}{detail}"


REPLAYS = GraphVerdict()


@dataclass(frozen=True)
class CallFacts:
    """What the rules read about one call (gathered by compiler/graphs/whole_call.py)."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    host: HostInputs
    device: str                          # the device of the call's first tensor argument
    lowering_pending: Callable[[], list]  # the regions still being lowered in the background
    record_on: tuple[str, ...] = ("cuda",)  # device types whose calls may be recorded (a fake recorder's tests: "cpu")


def _device(facts: CallFacts) -> GraphVerdict:
    recordable = torch.device(facts.device).type in facts.record_on
    return REPLAYS if recordable else GraphVerdict(GraphFallback.NOT_CUDA, facts.device)


def _patches(facts: CallFacts) -> GraphVerdict:
    unsafe: list[str] = []
    for value in (*facts.args, *facts.kwargs.values()):
        unsafe.extend(name for name in facts.host.graph_unsafe(value) if name not in unsafe)
    return GraphVerdict(GraphFallback.UNSAFE_PATCH, ", ".join(unsafe)) if unsafe else REPLAYS


def _observed(facts: CallFacts) -> GraphVerdict:
    observers = module_calls.observers_active()
    return GraphVerdict(GraphFallback.OBSERVED_MID_CALL, f"{observers} observer(s)") if observers else REPLAYS


def _lowering(facts: CallFacts) -> GraphVerdict:
    waiting = facts.lowering_pending()
    return GraphVerdict(GraphFallback.LOWERING_PENDING, ", ".join(waiting[:4])) if waiting else REPLAYS


def _weights(facts: CallFacts) -> GraphVerdict:
    device = torch.device(facts.device)
    for name, tensor in (*facts.module.named_parameters(), *facts.module.named_buffers()):
        if tensor.device != device:
            return GraphVerdict(GraphFallback.WEIGHTS_OFF_DEVICE, f"{name} is on {tensor.device}")
    note = facts.host.weights_note(facts.module)
    return GraphVerdict(GraphFallback.WEIGHTS_STREAMED, note) if note else REPLAYS


RULES: tuple[Callable[[CallFacts], GraphVerdict], ...] = (_device, _patches, _observed, _lowering, _weights)
# the rules that read only the weights: their verdict holds while the weights' addresses do
# (compiler/graphs/whole_call.py asks them again only when the addresses move)
WEIGHT_RULES = (_weights,)


def call_verdict(facts: CallFacts, rules=RULES) -> GraphVerdict:
    """The first objection of `rules`, in order, or REPLAYS."""
    for rule in rules:
        verdict = rule(facts)
        if not verdict.replays:
            return verdict
    return REPLAYS


def call_device(args: tuple, kwargs: dict) -> str:
    """The device of a call's first tensor argument ("cpu" if it has none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return str(value.device)
    return "cpu"


__all__ = ["GraphFallback", "GraphVerdict", "CallFacts", "call_verdict", "call_device", "RULES", "WEIGHT_RULES", "REPLAYS"]
