"""benchmarks/side_by_side.py: every variant of a side-by-side bench is called on inputs of its own, so the
sizes Kiln marks dynamic on the tensors it is called with never reach another variant's compile."""
import torch

import kiln
from kiln.benchmarks import bench, gpu_suite
from kiln.benchmarks.side_by_side import own_inputs, time_interleaved


def test_a_kiln_model_marks_the_sizes_of_the_tensors_it_is_called_with():
    """What the rule guards against: after a call of a whole-model compile the caller's own latent
    carries TorchDynamo's dynamic-size record, which a torch.compile called on it next would follow."""
    module = torch.nn.Conv2d(4, 4, 3, padding=1).eval()
    compiled = kiln.compile(module, options=kiln.CompileOptions(mode="fast", compile_unit="whole"))
    latent = torch.randn(2, 4, 8, 8)
    (mine,), _ = own_inputs((latent,), {})
    with torch.no_grad():
        compiled(mine)
    assert getattr(mine, "_dynamo_weak_dynamic_indices", None)
    assert not hasattr(latent, "_dynamo_weak_dynamic_indices") and torch.equal(mine, latent)


def test_interleaved_rounds_call_each_variant_on_its_own_inputs():
    seen: dict[str, set] = {"a": set(), "b": set()}

    def variant(name):
        return lambda x, scale=None: seen[name].add((id(x), id(scale)))

    x, scale = torch.ones(2), torch.ones(1)
    inputs = {name: own_inputs((x,), {"scale": scale}) for name in seen}
    times = time_interleaved({name: variant(name) for name in seen}, inputs, "cpu", rounds=2, steps=2)
    assert {name: len(samples) for name, samples in times.items()} == {"a": 2, "b": 2}
    assert seen["a"] == {(id(inputs["a"][0][0]), id(inputs["a"][1]["scale"]))}
    assert seen["b"] == {(id(inputs["b"][0][0]), id(inputs["b"][1]["scale"]))} != seen["a"]


def _distinct(called: dict[str, list]) -> bool:
    """Each variant was called on one tensor of its own (the tensors are kept, so no id is reused)."""
    first = {name: tensors[0] for name, tensors in called.items()}
    return (all(t is first[name] for name, tensors in called.items() for t in tensors)
            and len({id(t) for t in first.values()}) == len(first))


def test_kiln_bench_gives_no_two_variants_the_same_tensors(monkeypatch):
    called: dict[str, list] = {"eager": [], "torch.compile": []}

    def recording(name):
        def call(x, *args, **kwargs):
            called[name].append(x)
            return (x * 1.0,)
        return call

    monkeypatch.setattr(bench, "_variants", lambda *a, **k: {name: recording(name) for name in called})
    monkeypatch.setattr(bench, "warm_up_compiler", lambda device: 0.0)
    bench.run_bench("vae", "tiny", rounds=1, steps=1, log=lambda msg: None)
    assert all(called.values()) and _distinct(called)


class _Recording(torch.nn.Module):
    def __init__(self, module, calls: list):
        super().__init__()
        self.module, self.calls = module, calls

    def forward(self, x, *args, **kwargs):
        self.calls.append(x)
        return self.module(x, *args, **kwargs)


def test_the_gpu_suite_gives_no_two_variants_the_same_tensors(monkeypatch):
    called: dict[str, list] = {"eager": [], "torch.compile": []}
    for name, calls in called.items():
        monkeypatch.setitem(gpu_suite.VARIANTS, name, lambda module, calls=calls: _Recording(module, calls))
    case = next(c for c in gpu_suite.TINY_CASES if c.name == "vae-decode-tiny")
    rows = gpu_suite.run_case(case, list(called), "cpu", "tiny", reps=1, ceiling=1.0, log=lambda msg: None)
    assert not any(r.error for r in rows) and all(called.values()) and _distinct(called)
