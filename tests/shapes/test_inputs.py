"""Batch changes reuse one graph, and nothing keeps the batch it was traced at (onediff's bug)."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing.models import MODELS
from testing_utils import rel_err


class BatchShaped(torch.nn.Module):
    """expand / view / interpolate sizes derived from the batch, as timestep embeddings and upsamplers do."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, t, context):
        b = x.shape[0]
        emb = t.expand(b)[:, None] * torch.linspace(0, 1, 8)  # timestep broadcast to the batch
        h = x + emb.view(b, 8, 1, 1) + self.proj(context).mean(1).reshape(b, 8, 1, 1)
        return F.interpolate(h, size=(x.shape[2] * 2, x.shape[3] * 2), mode="nearest")


def _inputs(b):
    return torch.randn(b, 8, 5, 7), torch.full((b,), 3.0), torch.randn(b, 7, 8)


@pytest.mark.parametrize("mode", ["fast", "balanced"])
def test_one_graph_serves_every_batch_and_follows_it(mode):
    module = BatchShaped()
    compiled = kiln.compile(module, mode=mode)
    for b in (2, 4, 6, 8, 3, 2):
        args = _inputs(b)
        out = compiled(*args)
        assert out.shape == (b, 8, 10, 14)
        assert rel_err(out, module(*args)) < 1e-5
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and info.compiles[0].dynamic


def test_batch_one_is_its_own_graph_with_the_reason():
    module = BatchShaped()
    compiled = kiln.compile(module, mode="fast")
    compiled(*_inputs(2))
    args = _inputs(1)
    assert rel_err(compiled(*args), module(*args)) < 1e-5
    info = kiln.stats(compiled)
    assert info.compile_count == 2 and "recompile" in info.recompiles[0].reason


def test_the_reason_is_found_for_a_torch_nn_container_too():
    """TorchDynamo files the guard failure under a wrapper frame of its own when the compiled
    forward is torch.nn's (nn.Sequential), not under Sequential.forward: the reason must still be
    TorchDynamo's, not a guessed graph break."""
    module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.SiLU())
    compiled = kiln.compile(module, mode="fast")
    compiled(torch.randn(3, 6))
    compiled(torch.randn(2, 3, 6))  # another rank: a guard fails
    info = kiln.stats(compiled)
    assert info.compile_count == 2
    assert info.recompiles[0].reason.startswith("recompile:"), info.recompiles[0].reason


class WithResiduals(torch.nn.Module):
    """ComfyUI's UNet with a ControlNet applied: residuals at each block's resolution, passed nested in
    `control={"input": [...], "output": [...]}`, added to activations derived from the latent."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x, control=None):
        h = self.down(x)
        if control is not None:
            h = h + control["input"][0]
        out = self.up(h)
        return out + control["output"][0] if control is not None else out


def _residuals(b, h, w):
    return torch.randn(b, 4, h, w), {"input": [torch.randn(b, 8, h // 2, w // 2)], "output": [torch.randn(b, 4, h, w)]}


def test_nested_residuals_follow_the_batch_and_resolution():
    """Left static, one residual pins the whole graph to the size it was traced at (ControlNet on
    ComfyUI's UNet recompiled at every resolution): nested 4-D inputs of the batch are dynamic too."""
    module = WithResiduals()
    compiled = kiln.compile(module, mode="fast")
    for b, h, w in [(2, 8, 8), (2, 12, 16), (4, 8, 8), (3, 16, 12)]:
        x, control = _residuals(b, h, w)
        assert rel_err(compiled(x, control=control), module(x, control=control)) < 1e-5
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and info.compiles[0].dynamic, info.summary()


class WithHint(torch.nn.Module):
    """A ControlNet: one hint image (batch 1, 2x the latent's size here) broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.hint = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x, hint):
        return x + self.hint(hint)


def test_a_hint_of_batch_one_follows_the_resolution():
    module = WithHint()
    compiled = kiln.compile(module, mode="fast")
    for b, h, w in [(2, 8, 8), (2, 12, 16), (4, 10, 8)]:
        x, hint = torch.randn(b, 4, h, w), torch.randn(1, 3, 2 * h, 2 * w)
        assert rel_err(compiled(x, hint), module(x, hint)) < 1e-5
    assert kiln.stats(compiled).compile_count == 1, kiln.stats(compiled).summary()


def test_static_when_asked():
    module = BatchShaped()
    compiled = kiln.compile(module, mode="fast", dynamic=False)
    compiled(*_inputs(2))
    compiled(*_inputs(4))
    info = kiln.stats(compiled)
    assert info.compile_count == 2 and not info.compiles[0].dynamic
    assert "size mismatch" in info.recompiles[0].reason


def test_onediff_scenario_on_an_sd15_unet():
    """Batch 1, 2, 3, 4 then 1 again with CFG (the UNet sees 2, 4, 6, 8, 2): one compile, eager results."""
    spec = MODELS["sd15"]
    unet = spec.build("tiny")
    compiled = kiln.compile(unet, options=kiln.CompileOptions(mode="fast", measure_regions=False))  # every region
    for user_batch in (1, 2, 3, 4, 1):
        args, kwargs = spec.inputs(unet, batch=2 * user_batch, seed=user_batch)
        assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-4
    info = kiln.stats(compiled)
    assert info.regions and info.compile_count == len(info.regions) and not info.recompiles, info.summary()


def test_a_call_dynamo_leaves_eager_is_reported():
    """Past TorchDynamo's recompile limit a new shape silently runs eagerly; Kiln must say so."""
    import torch._dynamo.config as dynamo_config

    torch._dynamo.reset()
    module = BatchShaped()
    compiled = kiln.compile(module, mode="fast", dynamic=False)
    # config.patch, not monkeypatch: on torch 2.11 undoing a monkeypatched config attribute deletes it
    with dynamo_config.patch(recompile_limit=1):
        compiled(*_inputs(2))
        args = _inputs(4)
        assert rel_err(compiled(*args), module(*args)) < 1e-5  # needs a second graph, refused by the limit: eager
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and info.eager_calls == 1
    assert "ran a call eagerly" in info.eager_call_reason and info.eager_call_reason in info.warnings
    info.warnings.insert(0, "an earlier warning of another kind")  # the summary gives the eager calls' own reason
    assert f"1 call(s) ran eagerly: {info.eager_call_reason}" in info.summary()


def test_slices_are_made_dense_and_dense_layouts_are_kept():
    from kiln.compiler.shapes.inputs import contiguous_inputs

    x = torch.randn(2, 4, 9, 9)
    tile = x[:, :, 1:6, 2:8]
    channels_last = x.contiguous(memory_format=torch.channels_last)
    transposed = x.transpose(2, 3)
    (a, b, c), kw = contiguous_inputs((tile, channels_last, transposed), {"context": x, "flag": 3})
    assert a.is_contiguous() and torch.equal(a, tile)
    assert b is channels_last and kw["context"] is x and kw["flag"] == 3
    # a dense view (the transpose) keeps its layout and memory, detached from its base
    assert c.stride() == transposed.stride() and c.data_ptr() == transposed.data_ptr() and not c._is_view()
    view = torch.nn.functional.linear(torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5))  # a 3-D Linear: a view
    (d,), _ = contiguous_inputs((view,), {})
    assert view._is_view() and not d._is_view() and d.data_ptr() == view.data_ptr()  # the same memory, no base
    # a contiguous slice of a batch of 1 gets a fresh tensor's strides over the same memory, no base
    joint = torch.randn(1, 7, 5)
    (e,), _ = contiguous_inputs((joint[:, 2:],), {})
    assert e.stride() == (25, 5, 1) and joint[:, 2:].stride() == (35, 5, 1)
    assert e.data_ptr() == joint[:, 2:].data_ptr() and torch.equal(e, joint[:, 2:]) and not e._is_view()


def test_tensors_in_walks_containers_to_a_bound_even_one_that_holds_itself():
    """A block's arguments come from a workflow's nodes: a dict that holds itself or nesting without
    end must not hang or exhaust the stack; tensors deeper than the bound are not marked."""
    from kiln.compiler.shapes.inputs import tensors_in

    a, b, deep = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    options = {"rotary": (a, b), "deeper": ([deep],)}  # a and b three containers in, deep four
    options["self"] = options
    nested = deep
    for _ in range(10_000):
        nested = [nested]
    found = list(tensors_in({"options": options, "nested": nested}, depth=3))
    assert any(t is a for t in found) and any(t is b for t in found) and not any(t is deep for t in found)
    assert len(found) == 2  # the dict that holds itself is walked to the bound, not for ever
