"""A whole call's steps with the fake recorder: settle, record, replay, re-capture, fall back, guard."""
import torch

from kiln.compiler.graphs.fake_recorder import FakeRecorder
from kiln.compiler.graphs.graph_safety import GraphFallback
from kiln.compiler.graphs.whole_call import WholeCallGraphs
from kiln.compiler.host_inputs import HostInputs, use_host_inputs


class Counted:
    """A model compiled by torch.compile with a backend that counts its compiles."""

    def __init__(self, module):
        self.module = module
        self.compiles = 0
        self.runs = 0

        def backend(gm, example_inputs):
            self.compiles += 1
            return gm.forward

        self.compiled = torch.compile(lambda x, scale: module(x) * scale, backend=backend, dynamic=False)

    def run(self, args, kwargs):
        self.runs += 1
        return self.compiled(*args, **kwargs)


def graphs_for(model, recorder=None, limit=4, warnings=None):
    notes = warnings if warnings is not None else []

    def warn(note):
        if note in notes:
            return False
        notes.append(note)
        return True

    return WholeCallGraphs(model.module, recorder or FakeRecorder(model.module), limit, lambda: model.compiles,
                           warn=warn, record_on=("cpu",))


def test_settle_record_replay_and_check_once():
    model = Counted(torch.nn.Linear(4, 4))
    graphs = graphs_for(model)
    xs = [torch.randn(2, 4) for _ in range(5)]
    outs = [graphs(model.run, (x,), {"scale": 2.0}) for x in xs]
    for x, out in zip(xs, outs):
        assert torch.allclose(out, model.module(x) * 2)
    report = graphs.report
    assert (report.recordings, report.replays, report.recaptures) == (1, 3, 0)
    # call 1 compiles, call 2 compiles nothing (settled), call 3 warms up and records, call 4's replay is
    # checked against the call without graphs, call 5 only replays; the fake recorder's 3 replays run it too
    assert model.runs == 1 + 1 + 2 + 1 + 3
    assert graphs.guard.extra_calls == 1 and not graphs.guard.failures
    assert "1 recording(s) (0 re-captured for new weights)" in report.line()


def test_outputs_stay_valid_after_the_next_call():
    model = Counted(torch.nn.Linear(4, 4))
    graphs = graphs_for(model)
    for _ in range(3):
        graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
    x1, x2 = torch.randn(2, 4), torch.randn(2, 4)
    first = graphs(model.run, (x1,), {"scale": 1.0})
    graphs(model.run, (x2,), {"scale": 1.0})
    assert torch.allclose(first, model.module(x1))


def test_a_new_number_or_shape_is_a_new_recording_never_a_stale_one():
    model = Counted(torch.nn.Linear(4, 4))
    graphs = graphs_for(model)
    for scale in (1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0):
        x = torch.randn(2, 4)
        assert torch.allclose(graphs(model.run, (x,), {"scale": scale}), model.module(x) * scale)
    assert graphs.report.recordings == 2


def test_new_weights_recapture_without_recompiling():
    model = Counted(torch.nn.Linear(4, 4))
    graphs = graphs_for(model)
    for _ in range(3):
        graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
    assert graphs.report.recordings == 1
    compiles = model.compiles
    model.module.weight = torch.nn.Parameter(torch.randn(4, 4))  # a LoRA installs a new tensor
    x = torch.randn(2, 4)
    assert torch.allclose(graphs(model.run, (x,), {"scale": 1.0}), model.module(x))  # no stale weights
    model.module.weight.data.mul_(0.5)  # an in-place strength change: same addresses, no capture
    x = torch.randn(2, 4)
    assert torch.allclose(graphs(model.run, (x,), {"scale": 1.0}), model.module(x))
    assert model.compiles == compiles
    assert (graphs.report.recordings, graphs.report.recaptures) == (2, 1)


def test_a_missed_input_copy_is_caught_by_the_guard():
    model = Counted(torch.nn.Linear(4, 4))
    warnings = []
    graphs = graphs_for(model, FakeRecorder(model.module, skip_copy=frozenset({"args[0]"})), warnings=warnings)
    for _ in range(3):  # compiled, settled, recorded
        graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
    x = torch.randn(2, 4)
    out = graphs(model.run, (x,), {"scale": 1.0})  # the first replay on new inputs: checked, failed
    assert torch.allclose(out, model.module(x))  # the call's answer is the one without graphs
    assert len(graphs.guard.failures) == 1
    assert any(GraphFallback.GUARD_FAILED.value in note and "rel L2" in note for note in warnings)
    x = torch.randn(2, 4)
    assert torch.allclose(graphs(model.run, (x,), {"scale": 1.0}), model.module(x))  # no graphs for it any more
    assert graphs.report.replays == 2 and graphs.report.nbytes == 0


def test_compiling_during_capture_aborts_it():
    model = Counted(torch.nn.Linear(4, 4))
    warnings = []
    graphs = graphs_for(model, warnings=warnings)
    graphs.marker = lambda: 0  # a call that compiled is taken as settled
    run = model.run

    def compiling(args, kwargs):
        model.compiles += 1
        return run(args, kwargs)

    for _ in range(3):
        graphs(compiling, (torch.randn(2, 4),), {"scale": 1.0})
    assert graphs.report.recordings == 0
    assert warnings == [f"runs without CUDA graphs: {GraphFallback.CAPTURE_RECOMPILED.value}: it still compiled "
                        "after 3 warm-up calls (MAX_WARMUP_CALLS)"]


def test_a_failed_capture_falls_back_with_its_reason():
    model = Counted(torch.nn.Linear(4, 4))
    warnings = []
    graphs = graphs_for(model, warnings=warnings)
    calls = [0]

    def syncing(args, kwargs):
        calls[0] += 1
        if calls[0] == 3:  # the third call's warm-up, before its capture
            raise RuntimeError("operation not permitted when stream is capturing")
        return model.run(args, kwargs)

    for _ in range(3):
        x = torch.randn(2, 4)
        assert torch.allclose(graphs(syncing, (x,), {"scale": 1.0}), model.module(x))
    assert "CUDA graphs: recording the call failed: RuntimeError: operation not permitted" in warnings[0]


def test_budget_and_unsafe_patches_are_said_once():
    class Host(HostInputs):
        def graph_unsafe(self, value):
            return ("attn2_patch: stateful",) if isinstance(value, dict) and value.get("stateful") else ()

        def call_fingerprint(self, value):
            return ("opts",) if isinstance(value, dict) else None

    use_host_inputs(Host())
    model = Counted(torch.nn.Linear(4, 4))
    warnings = []
    graphs = graphs_for(model, limit=1, warnings=warnings)
    for _ in range(2):
        graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
        graphs(model.run, (torch.randn(3, 4),), {"scale": 1.0})
        graphs(lambda a, k: model.run(a, {"scale": 1.0}), (torch.randn(2, 4),), {"scale": {"stateful": True}})
    assert graphs.report.recordings == 1
    assert len(warnings) == 2
    assert GraphFallback.BUDGET_FULL.value in warnings[0]
    assert warnings[1].endswith("attn2_patch: stateful")
    assert sum(graphs.report.fallbacks.values()) == 4


def test_cpu_calls_are_not_recorded_and_nothing_is_said():
    model = Counted(torch.nn.Linear(4, 4))
    warnings = []
    graphs = WholeCallGraphs(model.module, FakeRecorder(model.module), 4, lambda: model.compiles,
                             warn=warnings.append)
    for _ in range(3):
        graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
    assert graphs.report.recordings == 0 and warnings == [] and graphs.report.fallbacks == {}


def test_the_weights_rules_are_asked_again_only_when_the_weights_move():
    asked = []

    class Host(HostInputs):
        def weights_note(self, module):
            asked.append(1)
            return ""

    use_host_inputs(Host())
    model = Counted(torch.nn.Linear(4, 4))
    graphs = graphs_for(model)
    for _ in range(3):
        graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
    assert len(asked) == 1
    model.module.weight = torch.nn.Parameter(torch.randn(4, 4))
    graphs(model.run, (torch.randn(2, 4),), {"scale": 1.0})
    assert len(asked) == 2
