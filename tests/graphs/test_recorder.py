"""torch.cuda.CUDAGraph recordings of a whole call (on a CUDA machine; skipped elsewhere), and the planted
faults the fidelity guard must catch there."""
import pytest
import torch

from kiln.compiler.graphs.graph_safety import GraphFallback
from kiln.compiler.graphs.recorder import CudaGraphRecorder
from kiln.compiler.graphs.whole_call import WholeCallGraphs
from kiln.compiler.host_inputs import HostInputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SkippingRecorder(CudaGraphRecorder):
    """Plants a missed input copy: the recording's replays never copy `args[0]` in."""

    def record(self, *a, **k):
        recording = super().record(*a, **k)
        copy_in = recording.inputs.copy_in
        recording.inputs.copy_in = lambda args, kwargs: copy_in(args, kwargs, frozenset({"args[0]"}))
        return recording


def net_on_cuda():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).cuda()


def graphs_for(net, recorder, warnings):
    return WholeCallGraphs(net, recorder, 4, lambda: 0, warn=lambda note: warnings.append(note) or True)


@cuda
def test_replays_match_eager_and_outputs_survive_the_next_call():
    net = net_on_cuda()
    recording = CudaGraphRecorder("cuda").record(lambda a, k: net(a[0]), (torch.randn(8, 64, device="cuda"),), {},
                                                 HostInputs(), lambda: 0)
    x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    first = recording.replay((x1,), {}).clone()
    recording.replay((x2,), {})
    torch.testing.assert_close(first, net(x1))
    assert recording.nbytes > 0


@cuda
def test_whole_call_recaptures_for_new_weights_and_the_guard_passes():
    net = net_on_cuda()
    warnings = []
    graphs = graphs_for(net, CudaGraphRecorder("cuda"), warnings)
    run = lambda a, k: net(a[0])  # noqa: E731
    for _ in range(4):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(graphs(run, (x,), {}), net(x))
    net[0].weight = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    for _ in range(2):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(graphs(run, (x,), {}), net(x))
    assert (graphs.report.recordings, graphs.report.recaptures) == (2, 1)
    assert not graphs.guard.failures and warnings == []


@cuda
def test_planted_missed_copy_is_caught_on_cuda():
    net = net_on_cuda()
    warnings = []
    graphs = graphs_for(net, SkippingRecorder("cuda"), warnings)
    run = lambda a, k: net(a[0])  # noqa: E731
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(graphs(run, (x,), {}), net(x))
    assert len(graphs.guard.failures) == 1
    assert GraphFallback.GUARD_FAILED.value in warnings[0]


@cuda
def test_a_host_sync_fails_the_capture_with_its_reason():
    net = net_on_cuda()
    warnings = []
    graphs = graphs_for(net, CudaGraphRecorder("cuda"), warnings)

    def syncing(a, k):
        out = net(a[0])
        return out * float(out.abs().max().item() > 0)

    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(graphs(syncing, (x,), {}), net(x))
    assert GraphFallback.CAPTURE_FAILED.value in warnings[0]
    assert graphs.report.recordings == 0


def test_no_collection_during_a_capture():
    import gc

    from kiln.compiler.graphs.recorder import no_collection

    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
