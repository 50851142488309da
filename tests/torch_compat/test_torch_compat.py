"""compiler/torch_compat/: the scoped settings and routes a model compiled by blocks enters on every call."""
import pytest
import torch
import torch.fx.experimental._config as fx_config

from kiln.compiler.torch_compat import dynamo, fx_graphs, module_calls
from testing_utils import fake_caches_of


def test_a_config_scope_sets_its_values_inside_and_puts_them_back_after_even_on_an_error():
    assert fx_config.use_duck_shape is True
    scope = dynamo.ConfigScope(fx_config, {"use_duck_shape": False})
    with scope:
        assert fx_config.use_duck_shape is False
    assert fx_config.use_duck_shape is True
    with pytest.raises(ValueError), scope:  # the same scope again, left by an error
        assert fx_config.use_duck_shape is False
        raise ValueError("the model's own error")
    assert fx_config.use_duck_shape is True


def test_no_duck_sizing_and_the_recompile_limit_are_scoped():
    before = dynamo.recompile_limit()
    with dynamo.no_duck_sizing(), dynamo.recompile_limit_at_least(before + 50):
        assert fx_config.use_duck_shape is False and dynamo.recompile_limit() == before + 50
    assert fx_config.use_duck_shape is True and dynamo.recompile_limit() == before
    with dynamo.recompile_limit_at_least(1):  # already at least that: left as it is
        assert dynamo.recompile_limit() == before


def _fake_caches_seen_by_a_capture(dynamic) -> set:
    """Whether the fake tensors of a capture that starts here cache their dispatches (fake_caches_of)."""
    seen = set()

    def backend(gm, example_inputs):
        seen.update(fake_caches_of(gm, example_inputs))
        return gm.forward

    torch.compile(lambda x: torch.relu(x) + 1, backend=backend, dynamic=dynamic)(torch.randn(3))
    return seen


def test_no_fake_dispatch_cache_where_sizes_are_symbolic_scoped_even_on_an_error():
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.fake_tensor_cache_enabled  # True unless TORCH_FAKE_TENSOR_DISPATCH_CACHE=0
    with dynamo.no_fake_dispatch_cache():
        assert _fake_caches_seen_by_a_capture(dynamic=True) == {False}
    assert dynamo_config.fake_tensor_cache_enabled is before
    assert _fake_caches_seen_by_a_capture(dynamic=True) == {before}
    with dynamo.no_fake_dispatch_cache(symbolic_sizes=False):  # static sizes: as torch has it
        assert _fake_caches_seen_by_a_capture(dynamic=False) == {before}
    with pytest.raises(ValueError), dynamo.no_fake_dispatch_cache():
        raise ValueError("the model's own error")
    assert dynamo_config.fake_tensor_cache_enabled is before


def test_no_fake_dispatch_cache_leaves_a_torch_without_the_setting_as_it_is(monkeypatch):
    import torch._dynamo.config as dynamo_config

    monkeypatch.delattr(dynamo_config, "fake_tensor_cache_enabled")
    with dynamo.no_fake_dispatch_cache():
        assert not hasattr(dynamo_config, "fake_tensor_cache_enabled")


def test_calls_routed_routes_inside_and_puts_back_what_was_installed_before():
    block, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    installed = other.__dict__.get("_compiled_call_impl")  # what nn.Module set up, if anything
    block._compiled_call_impl = lambda *a: "installed by someone else"
    x = torch.ones(1, 2)
    with module_calls.calls_routed({block: lambda *a: "routed", other: lambda *a: "routed too"}):
        assert block(x) == "routed" and other(x) == "routed too"
        assert "_compiled_call_impl" not in block._parameters and "_compiled_call_impl" not in block._modules
    assert block(x) == "installed by someone else"
    assert other.__dict__.get("_compiled_call_impl") is installed and isinstance(other(x), torch.Tensor)


def test_a_copied_graph_still_tells_aotautograd_which_inputs_are_weights():
    """A graph the shape manager lowers again for a pinned shape is a copy of TorchDynamo's. AOTAutograd
    finds which inputs are weights (CUDA graphs then read them in place, not copy them at every replay)
    from marks only TorchDynamo's own graph carried before; the copy keeps them."""
    try:  # where torch 2.11 - 2.13 keep it, with four arguments
        from torch._functorch._aot_autograd.frontend_utils import _try_get_metadata_from_dynamo
    except ImportError:
        pytest.skip("this torch reads TorchDynamo's marks elsewhere")

    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    linear = torch.nn.Linear(3, 5)
    try:
        torch.compile(lambda x: linear(x).relu(), backend=backend)(torch.randn(2, 3))
    finally:
        torch._dynamo.reset()
    original = captured[0]
    inputs = len(original.graph.find_nodes(op="placeholder"))

    def weights_of(gm):
        return _try_get_metadata_from_dynamo(gm, {}.keys(), inputs, [None] * inputs)[1]

    assert weights_of(original) and weights_of(fx_graphs.copy_graph_module(original)) == weights_of(original)


def test_this_torch_keeps_its_settings_per_thread_and_a_thread_started_in_a_copied_context_sees_them():
    """What lowering in the background rests on (compiler/regional/background.py), in the torch Kiln is tested with."""
    import contextvars
    import threading

    assert dynamo.settings_per_thread()
    seen = {}
    with dynamo.no_duck_sizing():
        context = contextvars.copy_context()
        plain = threading.Thread(target=lambda: seen.setdefault("plain", fx_config.use_duck_shape))
        copied = threading.Thread(target=context.run, args=(lambda: seen.setdefault("copied", fx_config.use_duck_shape),))
        plain.start(), copied.start(), plain.join(), copied.join()
    assert seen == {"plain": True, "copied": False} and fx_config.use_duck_shape is True
