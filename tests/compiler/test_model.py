"""KilnModel: the plan's handle and the guard every caller goes through (Python callers included)."""
import gc
import logging
import weakref

import pytest
import torch

import kiln
from kiln.compiler import KilnPlan, build_options, model_for
from kiln.compiler.backend import lowering as lowering_module
from testing_utils import rel_err


class Small(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x, transformer_options=None):
        return self.b(torch.relu(self.a(x)))


class Cancelled(Exception):
    """Stands in for ComfyUI's InterruptProcessingException, raised by its progress callback."""


def test_a_failed_compile_runs_eagerly_for_python_callers_too(monkeypatch, caplog):
    def broken(self, *args, **kwargs):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(lowering_module, "lower_graph", broken)
    module = Small()
    compiled = kiln.compile(module, mode="fast")
    x = torch.randn(3, 32)
    assert torch.equal(compiled(x), module(x))  # the call still answers, eagerly
    info = kiln.stats(compiled)
    assert "lowering exploded" in info.fallback and info.compile_count == 0
    assert "runs eagerly from now on" in caplog.text
    monkeypatch.undo()
    assert torch.equal(compiled(x), module(x)) and kiln.stats(compiled).compile_count == 0  # stays eager


def test_a_cancel_during_the_compile_is_re_raised_and_leaves_nothing_behind():
    module = Small()
    compiled = kiln.compile(module, mode="fast")

    def cancel(what, done, total):
        if what.startswith("pass fuse_geglu"):
            raise Cancelled("cancelled by the user")

    compiled.progress = cancel
    x = torch.randn(3, 32)
    with pytest.raises(Cancelled, match="cancelled by the user"):
        compiled(x)
    info = kiln.stats(compiled)
    assert info.fallback is None and info.compile_count == 0 and not info.variants
    compiled.progress = None  # the next prompt: it compiles again and runs
    assert rel_err(compiled(x), module(x)) < 1e-6
    assert info.compile_count == 1 and info.fallback is None


@pytest.mark.slow
def test_a_cancel_while_pinned_shapes_compile_leaves_nothing_half_installed():
    """The cancel comes after the dynamic graph is lowered, while the shape manager specialises the
    pinned shapes (inside the compiled call, not TorchDynamo's backend): the signature it was adding
    is dropped, so the next call compiles the pins again."""
    module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
    compiled = kiln.compile(module, options=build_options("balanced", pin_shapes="64x64:3").compile)

    def cancel(what, done, total):
        if what.startswith("specialising pinned"):
            raise Cancelled("cancelled")

    compiled.progress = cancel
    x = torch.randn(2, 4, 6, 6)
    with pytest.raises(Cancelled):
        compiled(x)
    info = kiln.stats(compiled)
    assert info.fallback is None and not info.variants and info.compile_count == 1
    compiled.progress = None
    assert rel_err(compiled(x), module(x)) < 1e-5
    assert [(v.how, v.note) for v in info.variants] == [("compiled", ""), ("specialised", "pinned, compiled ahead")]
    assert info.fallback is None and info.compile_count == 1  # the dynamic graph was kept; only the pins ran again


def test_options_objects_and_their_keyword_shorthands_are_one_plan(tmp_path):
    """kiln.compile(module, CompileOptions(...), cache=CacheOptions(...)), or the same in keywords: the same model."""
    module = Small()
    compiled = kiln.compile(module, kiln.CompileOptions(mode="fast", dynamic=False),
                            cache=kiln.CacheOptions(dir=str(tmp_path), mode="refresh"))
    assert kiln.compile(module, "fast", dynamic=False, cache_dir=str(tmp_path), cache="refresh") is compiled
    assert kiln.compile(module, mode="fast", dynamic=False, cache_dir=str(tmp_path), cache="refresh") is compiled
    assert compiled.plan.compile == kiln.CompileOptions(mode="fast", dynamic=False)
    assert compiled.plan.cache == kiln.CacheOptions(dir=str(tmp_path), mode="refresh")
    assert kiln.compile(module, options=kiln.CompileOptions(mode="fast")).plan.cache is None
    with pytest.raises(kiln.OptionsError, match="inside the CompileOptions"):
        kiln.compile(module, kiln.CompileOptions(), mode="fast")
    with pytest.raises(kiln.OptionsError, match="inside the CacheOptions"):
        kiln.compile(module, cache=kiln.CacheOptions(), cache_dir=str(tmp_path))


def test_same_plan_same_model_changed_plan_compiles_once_and_says_what_changed(caplog):
    module = Small()
    fast = kiln.compile(module, mode="fast")
    assert kiln.compile(module, mode="fast") is fast
    assert model_for(module, KilnPlan(compile=build_options("fast").compile)) is fast  # the nodes' way in: the same handle
    x = torch.randn(3, 32)
    fast(x)
    with caplog.at_level(logging.INFO, logger="kiln"):
        other = kiln.compile(module, options=build_options("fast", passes={"canonicalize_attention": "off"}).compile)
    assert other is not fast
    assert 'has a new plan (compile.passes.canonicalize_attention: unset -> "off")' in caplog.text
    other(x)
    assert kiln.stats(other).compile_count == 1 and kiln.stats(fast).compile_count == 1
    assert kiln.compile(module, mode="fast") is fast  # back to the first plan: its graphs are reused


def test_plan_parts_and_changes():
    plan = KilnPlan().with_parts(compile=build_options("balanced").compile)
    assert plan == KilnPlan(compile=build_options("balanced").compile) and plan.key == KilnPlan(compile=build_options("balanced").compile).key
    assert plan.changes_from(KilnPlan()) and 'compile.mode: unset -> "balanced"' in plan.changes_from(KilnPlan())
    assert plan.with_parts(compile=build_options("max").compile).changes_from(plan) == ['compile.mode: "balanced" -> "max"']
    with pytest.raises(ValueError, match="no part 'quantise'"):
        plan.with_parts(quantise=None)
    assert KilnPlan().describe() == "nothing" and plan.describe().startswith("compile (balanced")


def test_the_sigma_schedule_length_is_dynamic(comfy_host):
    """ComfyUI passes the whole sigma schedule down in transformer_options; its length is the step count."""

    class ReadsSigmas(Small):
        def forward(self, x, transformer_options=None):
            return self.a(x) * transformer_options["sample_sigmas"][0]

    module = ReadsSigmas()
    compiled = kiln.compile(module, mode="fast")
    x = torch.randn(3, 32)
    for steps in (5, 3, 8):
        options = {"sample_sigmas": torch.linspace(1, 0, steps)}
        assert rel_err(compiled(x, transformer_options=options), module(x, transformer_options=options)) < 1e-6
    assert kiln.stats(compiled).compile_count == 1, kiln.stats(compiled).summary()


def _rss_mib() -> float:
    """The resident set once glibc has handed freed heap back (freed 4 MiB weights otherwise stay
    in its arenas: RSS grows ~6 MiB a model with nothing alive; measured)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then over-counts, the bound below still holds on Linux CI
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_more_models_of_one_class_than_torchdynamos_recompile_limit_compile_and_go_with_the_model():
    """Load, compile, run and drop two more models of the same architecture than TorchDynamo's recompile
    limit: each compiles (none hits that limit, which used to be shared by every model of a class), and
    each goes away with everything Kiln made for it. 8 MiB of weights each: a leak of the models after the
    first two would be 8 MiB times the limit, over the bound of 24 MiB."""
    from kiln.compiler.torch_compat import dynamo

    width, refs, before, models = 1024, [], None, dynamo.recompile_limit() + 2
    for i in range(models):
        module = Small(width)
        compiled = kiln.compile(module, mode="fast")
        for batch in (2, 3, 1):
            compiled(torch.randn(batch, width))
        info = kiln.stats(compiled)
        assert info.compile_count >= 1 and info.eager_calls == 0 and info.fallback is None, info.summary()
        refs.append(weakref.ref(module))
        del module, compiled, info
        gc.collect()
        if i == 1:
            before = _rss_mib()  # after two models: torch's own one-time compile state is warm
    after = _rss_mib()
    alive = sum(r() is not None for r in refs)
    print(f"resident set after 2 models: {before:.1f} MiB, after {models}: {after:.1f} MiB ({after - before:+.1f} MiB); "
          f"models alive: {alive}")
    assert alive == 0
    assert after - before < 24, f"{after - before:.1f} MiB more after {models - 2} more models"
