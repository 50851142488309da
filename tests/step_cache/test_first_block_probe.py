"""The step cache's method first_block (compiler/step_cache/first_block_probe.py, compiler/step_cache/decision.py): the first
block's residual decides, a skipped step ends the model call there, eagerly and compiled alike."""
import types

import pytest
import torch

import kiln
from kiln.compiler import CompileOptions, StepCache, StepCacheError, StepCacheOptions, step_cached
from kiln.compiler.torch_compat import module_calls
from kiln.compiler.step_cache.first_block_probe import first_block_of, first_block_probed, first_tensor_input, residual


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x, emb):
        self.calls += 1
        return x + 0.3 * torch.tanh(self.fc(self.norm(x) + emb))


class TinyDiT(torch.nn.Module):
    """model(x, t): patchless tokens, a timestep embedding, four identical blocks."""

    def __init__(self, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out, self.time = torch.nn.Linear(4, dim), torch.nn.Linear(dim, 4), torch.nn.Linear(1, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(4))

    def forward(self, x, t):
        tokens = self.embed(x.flatten(2).transpose(1, 2))
        emb = self.time(t.reshape(-1, 1, 1).float() / 1000)
        for block in self.blocks:
            tokens = block(tokens, emb)
        return self.out(tokens).transpose(1, 2).reshape(x.shape)


def _run(model, steps=20, shape=(2, 4, 6, 6), seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    for i, t in enumerate(torch.linspace(999, 0, steps)):
        x = x + (model(x, t.repeat(shape[0])) - x) / (i + 2)
    return x


SKIPPING = {"method": "first_block", "threshold": 0.5, "start_percent": 0.1, "max_consecutive_skips": 2, "error_budget": 10}


def test_the_first_block_is_found_in_model_order_and_a_model_without_blocks_is_refused_by_name():
    model = TinyDiT()
    assert first_block_of(model) == ("blocks.0", model.blocks[0])
    with pytest.raises(StepCacheError, match="first_block needs a model made of blocks.*Linear.*method reuse"):
        step_cached(torch.nn.Linear(4, 4), {"method": "first_block"})


def test_the_residual_is_the_output_minus_the_input_it_updates():
    x, emb = torch.randn(2, 3), torch.randn(2, 5)
    assert torch.equal(first_tensor_input((), {"x": x, "emb": emb}), x)
    assert torch.equal(residual(x + 1, x), torch.ones(2, 3))
    assert torch.equal(residual((x * 2, emb), x), x)                  # a tuple's first tensor
    assert torch.equal(residual(emb, x), emb)                         # a block that changes the width: its output
    with pytest.raises(StepCacheError, match="returned str"):
        residual("no tensor", x)


def test_a_block_that_updates_its_input_in_place_still_shows_its_residual():
    """ComfyUI's Flux blocks add to `img` in place: the probe keeps a copy of the input."""
    class InPlace(Block):
        def forward(self, x, emb):
            x += 0.5
            return x

    block, seen = InPlace(16), []
    waiting = types.SimpleNamespace(probing=True, probe=seen.append)   # a cache inside a first_block step
    with first_block_probed(waiting, block):
        block(torch.zeros(1, 2, 16), torch.zeros(1, 1, 16))
    assert torch.equal(seen[0], torch.full((1, 2, 16), 0.5))


def test_threshold_zero_computes_every_block_of_every_step_bit_for_bit():
    plain = _run(TinyDiT())
    model = TinyDiT()
    cached = step_cached(model, {"method": "first_block", "threshold": 0})
    assert torch.equal(_run(cached), plain)
    assert [b.calls for b in model.blocks] == [20] * 4 and cached.report().skipped == 0


def test_a_skipped_step_runs_the_first_block_only_and_answers_the_kept_change():
    model = TinyDiT()
    cached = step_cached(model, SKIPPING)
    _run(cached)
    pattern = cached.report().patterns["all"]
    skipped = pattern.count("s")
    assert skipped > 0 and "sss" not in pattern and pattern.startswith("CC") and pattern.endswith("C")
    assert model.blocks[0].calls == 20 and [b.calls for b in model.blocks[1:]] == [20 - skipped] * 3
    assert 0 < cached.report().estimate_used < 0.5
    # a skip is x + (out - x) of the last computed step: the cached run stays near the uncached one
    assert (_run(cached) - _run(TinyDiT())).abs().max() < 0.2


def test_a_model_compiled_by_blocks_decides_like_eager_and_stays_compiled():
    eager = step_cached(TinyDiT(), SKIPPING)
    compiled_model = kiln.compile(TinyDiT(), CompileOptions(mode="fast", compile_unit="blocks"))
    compiled = step_cached(compiled_model, SKIPPING)
    a, b = _run(eager), _run(compiled)
    assert compiled.report().patterns == eager.report().patterns and compiled.report().skipped > 0
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    stats = kiln.stats(compiled_model)
    assert stats.fallback is None and not stats.region_fallbacks and stats.compile_count > 0
    count = stats.compile_count
    _run(compiled, steps=12, shape=(1, 4, 6, 8), seed=3)   # new settings of the run: nothing recompiles
    assert kiln.stats(compiled_model).compile_count == count


def test_a_compute_that_never_runs_the_first_block_is_refused():
    cache = StepCache(StepCacheOptions(method="first_block"))
    with pytest.raises(StepCacheError, match="without its first block reporting"):
        cache.step(torch.ones(1, 2), 0.0, lambda: torch.ones(1, 2))


def test_a_model_compiled_whole_is_refused_with_what_to_do():
    """One graph runs the blocks inside it: nothing can observe the first block's output there."""
    compiled = step_cached(kiln.compile(TinyDiT(), CompileOptions(mode="fast", compile_unit="whole")), SKIPPING)
    with pytest.raises(StepCacheError, match="compiled whole.*compile it by blocks.*method reuse"):
        _run(compiled, steps=3)


def test_a_call_of_the_first_block_outside_a_step_is_ignored():
    model = TinyDiT()
    cache = StepCache(StepCacheOptions(**SKIPPING))
    with first_block_probed(cache, model.blocks[0]):
        out = model(torch.randn(1, 4, 2, 2), torch.tensor([10.0]))
    assert out.shape == (1, 4, 2, 2) and cache.report().patterns == {}


def test_an_observed_block_keeps_a_route_installed_inside_and_both_are_put_back():
    block, seen = Block(4), []
    x, emb = torch.randn(1, 4), torch.zeros(1, 4)
    with module_calls.calls_observed(block, lambda args, kwargs: seen.append("before") or "token",
                               lambda out, token: seen.append(token) or out * 0):
        with module_calls.calls_routed({block: lambda *a: seen.append("routed") or torch.ones(1, 4)}):
            assert torch.equal(block(x, emb), torch.zeros(1, 4))
        assert seen == ["before", "routed", "token"]
        block(x, emb)
        assert seen[-1] == "token" and block.calls == 1
    assert block.__dict__.get("_compiled_call_impl") is None
    assert torch.equal(block(x, emb), x + 0.3 * torch.tanh(block.fc(block.norm(x))))


def test_kiln_compile_takes_the_step_cache_and_stats_read_through_it():
    model = kiln.compile(TinyDiT(), "fast", step_cache={"method": "first_block", "threshold": 0.5, "start_percent": 0.1,
                                                                "error_budget": 10})
    assert isinstance(model, kiln.compiler.StepCachedModel) and model.cache.options.method == "first_block"
    _run(model)
    assert model.report().skipped > 0 and kiln.stats(model).compile_count > 0
    with pytest.raises(kiln.compiler.OptionsError, match="step_cache=str"):
        kiln.compile(TinyDiT(), "fast", step_cache="first_block")
