"""Static buffers: one per tensor the key names, copied into before each replay."""
import pytest
import torch

from kiln.compiler.graphs.recording_key import recording_key
from kiln.compiler.graphs.static_inputs import StaticInputs, call_tensors
from kiln.compiler.host_inputs import HostInputs


class OptionsHost(HostInputs):
    def call_fingerprint(self, value):
        return ("opts",) if isinstance(value, dict) and value.get("host") else None


def test_buffers_follow_the_keys_walk_and_keep_layout():
    host = OptionsHost()
    x = torch.randn(4, 2).t()  # not contiguous
    kwargs = {"control": {"input": [torch.randn(2, 3)]}, "opts": {"host": True, "sigmas": torch.ones(2), "fn": print}}
    static = StaticInputs((x, 0.5), kwargs, host)
    key = recording_key(torch.nn.Linear(1, 1), (x, 0.5), kwargs, host)
    assert static.places == [spec.place for spec in key.tensors]
    assert static.buffers[0].stride() == x.stride() and torch.equal(static.buffers[0], x)
    assert static.buffers[0] is not x and static.args[1] == 0.5
    assert static.kwargs["opts"]["fn"] is print and static.kwargs["opts"]["sigmas"] is static.buffers[2]
    assert static.nbytes == sum(b.untyped_storage().nbytes() for b in static.buffers)


def test_copy_in_and_a_planted_miss():
    host = HostInputs()
    a, b = torch.zeros(3), torch.zeros(2)
    static = StaticInputs((a,), {"b": b}, host)
    new_a, new_b = torch.ones(3), torch.full((2,), 7.0)
    static.copy_in((new_a,), {"b": new_b}, skip=frozenset({"kwargs['b']"}))
    assert torch.equal(static.buffers[0], new_a)
    assert torch.equal(static.buffers[1], torch.zeros(2))  # missed: the previous call's values
    assert [place for place, _ in call_tensors((new_a,), {"b": new_b}, host)] == static.places


def test_copy_in_refuses_a_call_with_other_tensors():
    static = StaticInputs((torch.zeros(3),), {}, HostInputs())
    with pytest.raises(ValueError, match="its key should have told them apart"):
        static.copy_in((torch.zeros(3), torch.zeros(1)), {})
