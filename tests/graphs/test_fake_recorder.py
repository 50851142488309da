"""The fake recorder replays as a CUDA graph would: static buffers, baked Python values, fixed weights."""
import pytest
import torch

from kiln.compiler.graphs.fake_recorder import FakeRecorder, StaleWeights
from kiln.compiler.graphs.recorder import MAX_WARMUP_CALLS, CaptureAborted
from kiln.compiler.host_inputs import HostInputs


def scaled(net):
    def run(args, kwargs):
        return net(args[0]) * kwargs["scale"]
    return run


def test_replay_reads_static_buffers_and_baked_values():
    net = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    recording = FakeRecorder(net).record(scaled(net), (x,), {"scale": 2.0}, HostInputs(), lambda: 0)
    y = torch.randn(2, 3)
    assert torch.allclose(recording.replay((y,), {"scale": 2.0}), net(y) * 2)
    stale = recording.replay((y,), {"scale": 5.0})  # a number not keyed: replayed as recorded
    assert torch.allclose(stale, net(y) * 2)


def test_outputs_are_overwritten_by_the_next_replay():
    net = torch.nn.Linear(3, 3)
    recording = FakeRecorder(net).record(scaled(net), (torch.randn(2, 3),), {"scale": 1.0}, HostInputs(), lambda: 0)
    first = recording.replay((torch.zeros(2, 3),), {"scale": 1.0})
    kept = first.clone()
    recording.replay((torch.ones(2, 3),), {"scale": 1.0})
    assert not torch.equal(first, kept)  # a caller must clone: compiler/graphs/whole_call.py does


def test_missed_copy_and_moved_weights_show():
    net = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    recording = FakeRecorder(net, skip_copy=frozenset({"args[0]"})).record(scaled(net), (x,), {"scale": 1.0},
                                                                         HostInputs(), lambda: 0)
    assert torch.allclose(recording.replay((torch.randn(2, 3),), {"scale": 1.0}), net(x))
    net.weight = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.raises(StaleWeights):
        recording.replay((x,), {"scale": 1.0})


def test_warm_up_until_nothing_compiles_else_abort():
    net = torch.nn.Linear(3, 3)
    count = [0]

    def compiling(args, kwargs):
        count[0] += 1
        return net(args[0])

    with pytest.raises(CaptureAborted, match="MAX_WARMUP_CALLS"):
        FakeRecorder(net).record(compiling, (torch.randn(2, 3),), {}, HostInputs(), lambda: count[0])
    assert count[0] == MAX_WARMUP_CALLS
    settles = iter([0, 1, 1, 1, 1, 1])  # the first warm-up compiles, the second settles
    FakeRecorder(net).record(compiling, (torch.randn(2, 3),), {}, HostInputs(), lambda: next(settles))

