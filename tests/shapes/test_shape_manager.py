"""The shape manager: new batches and resolutions reuse one graph; specialisations are bounded."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing.models import MODELS
from kiln.compiler import build_options
from kiln.compiler.backend import lowering as lowering_module
from testing_utils import rel_err


class UNetLike(torch.nn.Module):
    """Down, up to the skip's size (odd sizes round-trip), timestep broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.down = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.conv_out = torch.nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x, t):
        b = x.shape[0]
        skip = self.conv_in(x) + t.view(b, 1, 1, 1).expand(b, 8, 1, 1)
        h = F.silu(self.norm(self.down(skip)))
        h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
        return self.conv_out(torch.cat([h, skip], dim=1))


def _inputs(batch, height, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, height, width, generator=g), torch.rand(batch, generator=g)


def _by_how(info):
    return [(v.how, v.signature.split(" (")[0], v.evicted) for v in info.variants]


def test_shuffled_resolutions_within_and_across_buckets_stay_within_the_bound():
    # buckets (w x h pixels) 64x64, 96x64, 80x80, 64x96 -> latents (h x w) 8x8, 8x12, 10x10, 12x8
    options = build_options("balanced", advanced="shapes: {specialize: buckets, buckets: [[64, 64], [96, 64], [80, 80], "
                                                 "[64, 96]], max_variants: 2}").compile
    module = UNetLike()
    compiled = kiln.compile(module, options=options)
    sequence = [(2, 8, 8), (2, 8, 12), (4, 7, 9), (2, 10, 10), (2, 8, 8), (2, 63, 64), (2, 12, 8), (6, 8, 12),
                (2, 8, 12), (3, 5, 11)]
    for i, shape in enumerate(sequence):
        args = _inputs(*shape, seed=i)
        assert rel_err(compiled(*args), module(*args)) < 1e-5, shape
    info = kiln.stats(compiled)
    assert info.compile_count == 1, info.summary()  # one TorchDynamo capture for every batch and resolution
    hows = _by_how(info)
    assert hows[0] == ("compiled", "batch 2, latent 8x8", False)
    specialised = [h for h in hows if h[0] == "specialised"]
    # the first shape is a bucket: specialised with the first compile. Bound 2, least recently used
    # evicted: 10x10 evicts 8x8, 8x8 comes back and evicts 8x12, 12x8 evicts 10x10, 8x12 evicts 8x8
    assert specialised == [("specialised", "batch 2, latent 8x8", True), ("specialised", "batch 2, latent 8x12", True),
                           ("specialised", "batch 2, latent 10x10", True), ("specialised", "batch 2, latent 8x8", True),
                           ("specialised", "batch 2, latent 12x8", False), ("specialised", "batch 2, latent 8x12", False)]
    assert info.evictions == 4
    # off-bucket and odd sizes, and bucket sizes at another batch, run on the dynamic graph: no compile
    reused = [h[1] for h in hows if h[0] == "reused"]
    assert reused == ["batch 4, latent 7x9", "batch 2, latent 63x64", "batch 6, latent 8x12", "batch 3, latent 5x11"]
    assert "shape signatures: 1 compiled, 6 specialised, 4 reused, 4 evicted" in info.summary()


def test_pinned_shapes_compile_with_the_first_compile_and_serve_their_signature():
    options = build_options("balanced").compile.replace(shapes=build_options("balanced").compile.shapes.with_pins("80x64:3"))
    module = UNetLike()
    compiled = kiln.compile(module, options=options)
    args = _inputs(2, 8, 8)
    assert rel_err(compiled(*args), module(*args)) < 1e-5
    info = kiln.stats(compiled)
    assert [(v.how, v.note) for v in info.variants] == [("compiled", ""), ("specialised", "pinned, compiled ahead")]
    assert info.variants[1].signature.startswith("batch 3, latent 8x10 (80x64 px)") and info.variants[1].calls == 0
    args = _inputs(3, 8, 10, seed=1)
    assert rel_err(compiled(*args), module(*args)) < 1e-5
    assert len(info.variants) == 2 and info.variants[1].calls == 1  # served by the pinned variant, nothing new


@pytest.mark.parametrize("advanced", ['shapes: {pin: ["64x64:2"]}', "shapes: {specialize: buckets, buckets: [[64, 64]]}"])
def test_the_first_shape_gets_static_kernels_when_pinned_or_a_bucket(advanced):
    """The shape sampled first is usually the one sampled most: pinned or a bucket, it is
    specialised with the first compile, and every later call at it runs the static variant."""
    module = UNetLike()
    compiled = kiln.compile(module, options=build_options("balanced", advanced=advanced).compile)
    for seed in range(3):
        args = _inputs(2, 8, 8, seed=seed)
        assert rel_err(compiled(*args), module(*args)) < 1e-5
    info = kiln.stats(compiled)
    assert [(v.how, v.calls) for v in info.variants] == [("compiled", 1), ("specialised", 2)], info.summary()
    assert info.variants[1].signature == info.variants[0].signature and info.compile_count == 1


def test_a_static_variant_never_runs_another_layout():
    options = build_options("balanced").compile.replace(shapes=build_options("balanced").compile.shapes.with_pins("64x64:2"))
    module = UNetLike()
    compiled = kiln.compile(module, options=options)
    compiled(*_inputs(2, 6, 6))
    x, t = _inputs(2, 8, 8)
    x_strided = x.transpose(2, 3).contiguous().transpose(2, 3)  # same sizes, other strides
    assert rel_err(compiled(x_strided, t), module(x_strided, t)) < 1e-5
    info = kiln.stats(compiled)
    # the pinned static variant of these sizes is not used for other strides (TorchDynamo's stride
    # guards even capture another graph for them)
    assert info.variants[1].note == "pinned, compiled ahead" and info.variants[1].calls == 0
    assert info.variants[-1].calls == 1 and info.variants[-1].how in ("reused", "compiled")


def test_a_failed_specialisation_is_reported_and_the_dynamic_graph_serves(monkeypatch):
    lower = lowering_module.lower_graph
    calls = []

    def fails_when_static(self, gm, example_inputs, options, device, cache_tag=""):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("no static kernels today")
        return lower(self, gm, example_inputs, options, device, cache_tag)

    monkeypatch.setattr(lowering_module, "lower_graph", fails_when_static)
    options = build_options("balanced", advanced="shapes: {specialize: buckets, buckets: [[80, 80]]}").compile
    module = UNetLike()
    compiled = kiln.compile(module, options=options)
    compiled(*_inputs(2, 8, 8))
    args = _inputs(2, 10, 10)
    assert rel_err(compiled(*args), module(*args)) < 1e-5
    info = kiln.stats(compiled)
    assert info.variants[-1].how == "reused" and info.variants[-1].note == "specialisation failed"
    assert "no static kernels today" in info.warnings[0]


def test_sd15_unet_new_batches_and_resolutions_reuse_the_graph():
    """The issue's scenario on a real architecture: batch and resolution change, one capture (of the
    whole model: the shape manager's variants are the whole graph's)."""
    spec = MODELS["sd15"]
    unet = spec.build("tiny")
    compiled = kiln.compile(unet, options=kiln.CompileOptions(mode="fast", compile_unit="whole"))
    for i, (batch, latent) in enumerate([(2, 8), (4, 8), (6, 12), (2, 10), (8, 16), (2, 8)]):
        args, kwargs = spec.inputs(unet, batch=batch, latent=latent, seed=i)
        assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-4
    info = kiln.stats(compiled)
    assert info.compile_count == 1, info.summary()
    assert info.variant_counts() == {"compiled": 1, "reused": 4}  # (2, 8) again is the first signature
    # an odd latent (not a multiple of the UNet's upsampling factor) takes diffusers' other branch:
    # one more graph, and the stats say why
    args, kwargs = spec.inputs(unet, batch=2, latent=7)
    assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-4
    assert info.compile_count == 2 and "% 2" in info.recompiles[0].reason


@pytest.mark.parametrize("dynamic", [False])
def test_static_compiles_have_no_shape_manager(dynamic):
    module = UNetLike()
    compiled = kiln.compile(module, mode="fast", dynamic=dynamic)
    compiled(*_inputs(2, 8, 8))
    assert kiln.stats(compiled).variants == []


@pytest.mark.parametrize("pin, fails, why", [
    ("4096x4096", None, "shapes.pin: 4096x4096: 4096x4096 at batch 5 is 83,886,080 pixels; the limit is 67,108,864"),
    ("64x64:2", RuntimeError("DefaultCPUAllocator: can't allocate memory"), "RuntimeError: DefaultCPUAllocator"),
])
def test_a_pinned_shape_whose_inputs_cannot_be_built_is_a_logged_failure(monkeypatch, pin, fails, why):
    """A pin's activations are allocated to compile it ahead: one without ':B' is held to the pixel
    budget at the first call's batch (5 here), and a failed allocation is that variant's failure,
    logged and warned, not an exception out of the model's first call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.compiler.shapes.shape_manager import ShapeDispatcher
    from kiln.compiler.stats import KilnStats

    x = torch.randn(5, 4, 8, 16)  # no two sizes equal: make_fx would give them one symbol
    gm = make_fx(lambda t: t * 2, tracing_mode="symbolic")(x)  # symbolic batch and latent, nothing compiled
    lowered = []
    policy = build_options("balanced", pin_shapes=pin + ", 64x128").compile.shapes
    stats = KilnStats(options={})
    dispatcher = ShapeDispatcher(gm, lambda *a: a[0], lambda g, a: lowered.append(tuple(a[0].shape)) or (lambda *b: b[0]),
                                 policy, stats, 0, 0.0, compile_pinned=True)
    real = torch.randn

    def randn(shape, **kwargs):  # the pin at batch 2 cannot be allocated
        if fails is not None and shape[0] == 2:
            raise fails
        return real(shape, **kwargs)

    monkeypatch.setattr(torch, "randn", randn)
    assert dispatcher(x) is x
    assert lowered == [(5, 4, 16, 8)]  # the other pin, 64x128, still compiled ahead
    assert len(stats.warnings) == 1 and stats.warnings[0].startswith(f"pinned shape {pin.split(':')[0]} at batch")
    assert why in stats.warnings[0] and "not compiled ahead" in stats.warnings[0]
    assert [v.how for v in stats.variants] == ["compiled", "specialised"]  # nothing recorded for the failed pin
