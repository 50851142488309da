"""The graph-safety rules: each fallback with its typed reason, in RULES order."""
import torch

from kiln.compiler.graphs.graph_safety import REPLAYS, CallFacts, GraphFallback, call_device, call_verdict
from kiln.compiler.host_inputs import HostInputs


class PatchHost(HostInputs):
    def graph_unsafe(self, value):
        return tuple(value.get("unsafe", ())) if isinstance(value, dict) else ()

    def weights_note(self, module):
        return "streamed" if getattr(module, "streamed", False) else ""


def facts(module=None, args=(), kwargs=None, device="cuda", pending=list, host=None):
    return CallFacts(module or torch.nn.Linear(2, 2), args, kwargs or {}, host or PatchHost(), device, pending,
                     ("cuda", "cpu", "meta"))


def test_a_plain_call_replays():
    assert call_verdict(facts(device="cpu")) is REPLAYS


def test_not_cuda_is_quiet():
    verdict = call_verdict(CallFacts(torch.nn.Linear(2, 2), (), {}, HostInputs(), "cpu", list))
    assert verdict.fallback is GraphFallback.NOT_CUDA and GraphFallback.NOT_CUDA.quiet
    assert not GraphFallback.UNSAFE_PATCH.quiet


def test_unsafe_patches_are_named():
    verdict = call_verdict(facts(kwargs={"opts": {"unsafe": ["attn2_patch: ipadapter", "sag"]}}, device="cpu"))
    assert verdict.fallback is GraphFallback.UNSAFE_PATCH
    assert verdict.message().endswith(": attn2_patch: ipadapter, sag")
    assert verdict.message().startswith("runs without CUDA graphs: the call holds patches")


def test_pending_lowering_then_weights():
    assert call_verdict(facts(device="cpu", pending=lambda: ["Block#2"])).detail == "Block#2"
    net = torch.nn.Linear(2, 2)
    net.streamed = True
    assert call_verdict(facts(net, device="cpu")).fallback is GraphFallback.WEIGHTS_STREAMED


def test_weights_off_the_device_name_the_weight():
    net = torch.nn.Linear(2, 2)
    verdict = call_verdict(facts(net, device="meta"))  # the call runs on another device than its weights
    assert verdict.fallback is GraphFallback.WEIGHTS_OFF_DEVICE and verdict.detail == "weight is on cpu"


def test_call_device():
    assert call_device((1, torch.ones(1)), {}) == "cpu"
    assert call_device((), {"x": torch.ones(1, device="meta")}) == "meta"
    assert call_device((), {}) == "cpu"


def test_a_block_observed_mid_call_falls_back():
    from kiln.compiler.torch_compat import module_calls

    net = torch.nn.Linear(2, 2)
    with module_calls.calls_observed(net, lambda args, kwargs: None, lambda out, seen: out):
        verdict = call_verdict(facts(net, device="cpu"))
    assert verdict.fallback is GraphFallback.OBSERVED_MID_CALL and "method reuse" in verdict.message()
    assert call_verdict(facts(net, device="cpu")) is REPLAYS
