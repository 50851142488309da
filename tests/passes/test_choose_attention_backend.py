"""choose_attention_backend: on CUDA each plain SDPA call runs the backend measured fastest for its shape;
on a CPU nothing changes. The CUDA case is played on a CPU graph with the choice injected."""
import operator

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.compiler.attention.choice import AttentionChoice
from kiln.compiler.passes import PassContext, PassResult
from kiln.compiler.passes import choose_attention_backend as pass_module
from kiln.compiler.attention.backends import run_external
from testing_utils import rel_err


class Attention(torch.nn.Module):
    def __init__(self, mask: bool = False):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool) if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25) * 2


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 3, 11, 8), torch.randn(2, 3, 13, 8), torch.randn(2, 3, 13, 8)


def test_replacement_equals_pattern():
    q, k, v = pass_module.example_inputs()
    assert rel_err(pass_module.replacement_attention_backend(q, k, v), pass_module.pattern_attention_backend(q, k, v)) < 1e-6


def test_on_a_cpu_nothing_changes_and_it_says_why():
    module, inputs = Attention(), _inputs()
    compiled = kiln.compile(module, mode="balanced")
    with torch.no_grad():
        assert rel_err(compiled(*inputs), module(*inputs)) < 1e-6
    (graph,) = kiln.stats(compiled).compiles
    assert graph.rewrites["choose_attention_backend"] == 0 and not graph.notes
    assert graph.skipped["choose_attention_backend"] == [
        "attention: cpu: SDPA picks its kernel; the choice is measured on CUDA (force with passes: on)"]


def test_forced_on_a_cpu_it_measures_among_what_a_cpu_runs_and_records_the_choice_with_the_compile():
    module, inputs = Attention(), _inputs()
    compiled = kiln.compile(module, options=kiln.CompileOptions(mode="balanced", passes={"choose_attention_backend": "on"}))
    with torch.no_grad():
        assert rel_err(compiled(*inputs), module(*inputs)) < 1e-5
    (graph,) = kiln.stats(compiled).compiles
    assert graph.rewrites["choose_attention_backend"] == 1
    (line,) = graph.notes["choose_attention_backend"]
    assert line.startswith("attention 2x3 heads, 11 x 13 tokens, d8, float32: math the only candidate left; left out: ")


def test_a_masked_attention_is_left_to_sdpa():
    module, inputs = Attention(mask=True), _inputs()
    compiled = kiln.compile(module, options=kiln.CompileOptions(mode="fast", passes={"choose_attention_backend": "on"}))
    with torch.no_grad():
        assert rel_err(compiled(*inputs), module(*inputs)) < 1e-6
    (graph,) = kiln.stats(compiled).compiles
    assert graph.skipped["choose_attention_backend"] == ["attention: it has an attention mask; SDPA picks its kernel"]


def _rewritten_on_cuda(monkeypatch, backend: str, inductor: bool):
    """The pass run as on CUDA (device_type "cuda") on a captured CPU graph, the choice injected: the
    graph's call targets afterwards, and what the choice was asked."""
    asked = []

    def chosen_for(key, device, scale, in_graph_only):
        asked.append((key, scale, in_graph_only))
        return AttentionChoice(key, backend, "GPU time", {backend: 1.0})

    monkeypatch.setattr(pass_module, "chosen_for", chosen_for)
    targets, results = [], []

    def backend_fn(gm, example_inputs):
        result = PassResult(pass_module.ChooseAttentionBackend.name)
        pass_module.ChooseAttentionBackend().apply(gm, PassContext(device_type="cuda", inductor=inductor), result)
        results.append(result)
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return lambda *args: (torch.zeros(1),)

    torch._dynamo.reset()
    torch.compile(Attention(), backend=backend_fn, fullgraph=True, dynamic=False)(*_inputs())
    torch._dynamo.reset()
    return targets, asked, results[0]


def test_on_cuda_the_chosen_sdpa_backend_is_called_by_its_aten_op(monkeypatch):
    targets, asked, result = _rewritten_on_cuda(monkeypatch, "flash", inductor=True)
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in targets and operator.getitem in targets
    assert F.scaled_dot_product_attention not in targets
    ((key, scale, in_graph_only),) = asked
    assert (key.batch, key.heads, key.q_tokens, key.kv_tokens, key.head_dim, key.v_dim, key.dtype) == \
        (2, 3, 11, 13, 8, 8, torch.float32)
    assert scale == 0.25 and in_graph_only  # Inductor lowers the graph: only in-graph backends
    assert result.rewrites == 1 and result.notes[0].startswith("attention 2x3 heads, 11 x 13 tokens, d8, float32: flash")


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_each_sdpa_backend_has_its_op(monkeypatch, backend):
    targets, _, _ = _rewritten_on_cuda(monkeypatch, backend, inductor=True)
    assert getattr(torch.ops.aten, f"_scaled_dot_product_{backend}_attention").default in targets


def test_without_inductor_an_external_kernel_is_a_python_call(monkeypatch):
    targets, asked, _ = _rewritten_on_cuda(monkeypatch, "sage", inductor=False)
    assert run_external in targets and asked[0][2] is False


def test_attention_of_folded_heads_runs_as_one_head_each():
    """Canonicalised hand-written attention has (batch x heads, tokens, dim): one head each."""
    class Folded(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v) + 1

    module = Folded()
    q, k, v = (t.flatten(0, 1) for t in _inputs())
    compiled = kiln.compile(module, options=kiln.CompileOptions(mode="fast", passes={"choose_attention_backend": "on"}))
    with torch.no_grad():
        assert rel_err(compiled(q, k, v), module(q, k, v)) < 1e-6
    (graph,) = kiln.stats(compiled).compiles
    assert graph.rewrites["choose_attention_backend"] == 1
    assert graph.notes["choose_attention_backend"][0].startswith("attention 6x1 heads, 11 x 13 tokens, d8, float32")
