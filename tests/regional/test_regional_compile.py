"""Compiling by blocks (compiler/regional/regional_compile.py): each distinct block compiled once, shared by identical blocks."""
import logging

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config

import kiln
from kiln.compiler import CompileOptions, OptionsError
from kiln.compiler.backend import lowering as lowering_module
from kiln.compiler.torch_compat import dynamo
from testing_utils import Block, fail_lowering_of_width, fake_caches_of, rel_err, two_region_net


class Cancelled(Exception):
    """Stands in for ComfyUI's InterruptProcessingException, raised by its progress callback."""


_net = two_region_net


def _compile(module, mode="fast", progress=None, cache_dir=None, **options):
    """These tests run blocks through compiled regions: every region with something to fuse stays
    compiled, whatever it measures (the measured choice: tests/regional/test_region_choice.py)."""
    return kiln.compile(module, options=CompileOptions(mode=mode, measure_regions=False, **options), progress=progress,
                        cache_dir=cache_dir)


def test_identical_blocks_share_one_graph_and_each_distinct_block_gets_its_own():
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert [(r.name, len(r.members)) for r in info.regions] == [("Block#1", 6), ("Block#2", 2)]
    assert info.compile_count == 2 and [c.region for c in info.compiles] == ["Block#1", "Block#2"]
    assert info.fallback is None and not info.region_fallbacks and info.eager_calls == 0
    assert "8 blocks in 2 regions" in info.summary() and "region 0 Block#1: blocks.0, blocks.1, blocks.2, ..." in info.summary()


def test_weights_changed_in_place_after_compiling_show_up_in_every_block():
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        compiled(x)
        for block in (module.blocks[0], module.blocks[4], module.wide[1]):
            block.fc.weight.mul_(-1.5)  # what a LoRA patch does: the same tensors, new values
        assert rel_err(compiled(x), module(x)) < 1e-6
    assert kiln.stats(compiled).compile_count == 2


class RotaryBlock(torch.nn.Module):
    """Takes what diffusers' Flux blocks take besides the tokens: a (cos, sin) tuple sized by the
    tokens, and a dict holding a tensor sized by the batch."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x, rotary, options):
        cos, sin = rotary
        return x + self.fc(x * cos + x.flip(-1) * sin) * options["scale"][:, None, None]


class RotaryNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(RotaryBlock() for _ in range(3))

    def forward(self, image):
        x = self.embed(image.flatten(2).transpose(1, 2))
        tokens = torch.arange(x.shape[1], dtype=x.dtype)[:, None] / 7 + torch.arange(16, dtype=x.dtype)
        rotary, options = (tokens.cos(), tokens.sin()), {"scale": torch.linspace(0.5, 1.5, x.shape[0])}
        for block in self.blocks:
            x = block(x, rotary, options)
        return x


def _rotary_net():
    torch.manual_seed(0)
    return RotaryNet().eval()


@pytest.mark.parametrize("make, graphs", [(_net, 2), (_rotary_net, 1)], ids=["tensors", "tensors in a tuple or dict"])
def test_a_new_batch_or_resolution_compiles_nothing(make, graphs):
    module = make()
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        compiled(torch.randn(2, 8, 3, 5))
        for shape in ((3, 8, 3, 5), (4, 8, 6, 4), (2, 8, 8, 8)):
            x = torch.randn(*shape)
            assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.compile_count == graphs and not info.recompiles, info.summary()


class JointBlock(torch.nn.Module):
    """Attends over its tokens and the text's together and hands both back as slices of one tensor, as
    diffusers' Flux single blocks do: at a batch of 1 the next block gets contiguous slices whose
    batch stride is not a fresh tensor's."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x, context):
        joint = torch.cat([context, x], dim=1)
        joint = joint + self.fc(joint)
        return joint[:, context.shape[1]:], joint[:, :context.shape[1]]


class JointNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.text = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(JointBlock() for _ in range(3))

    def forward(self, image, text):
        x, context = self.embed(image.flatten(2).transpose(1, 2)), self.text(text)
        for block in self.blocks:
            x, context = block(x, context)
        return x


@pytest.mark.parametrize("batch", [1, 2])
def test_blocks_handed_slices_of_one_tensor_share_the_first_graph(batch):
    torch.manual_seed(0)
    module = JointNet().eval()
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        for shape in ((batch, 8, 3, 5), (batch, 8, 4, 4)):
            x, text = torch.randn(*shape), torch.randn(batch, 7, 8)
            assert rel_err(compiled(x, text), module(x, text)) < 1e-6
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and not info.recompiles, info.summary()


class WeightedBlock(torch.nn.Module):
    """Reads a Python number from an object it is given, as ComfyUI blocks read an IPAdapter patch's weight."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x, patch):
        return x + self.fc(x) * patch.weight


class WeightedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(WeightedBlock() for _ in range(3))
        self.patch = type("Patch", (), {"weight": 1.0})()

    def forward(self, image):
        x = self.embed(image.flatten(2).transpose(1, 2))
        for block in self.blocks:
            x = block(x, self.patch)
        return x


def test_a_number_that_changes_at_a_size_already_run_costs_one_graph_and_later_sizes_none():
    """The number's change compiles one more graph, from a call at a size the first graph served; that
    graph is dynamic in every size too (each call's sizes are marked), so later sizes compile nothing."""
    torch.manual_seed(0)
    module = WeightedNet().eval()
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 8, 3, 5))
        module.patch.weight = 0.5  # what a new IPAdapter weight does: TorchDynamo makes it an input
        compiled(torch.randn(2, 8, 3, 5))
        for shape in ((3, 8, 3, 5), (2, 8, 6, 4)):
            x = torch.randn(*shape)
            assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.compile_count == 2 and len(info.recompiles) == 1 and info.fallback is None, info.summary()
    assert "weight" in info.compiles[1].reason


def test_progress_counts_regions_done():
    seen = []
    compiled = _compile(_net(), mode="fast", progress=lambda what, done, total: seen.append((what, done, total)))
    with torch.no_grad():
        compiled(torch.randn(2, 8, 3, 5))
    assert seen[0][0].startswith("region 1/2 Block#1: ") and seen[0][1:] == (0, 2)
    assert seen[-1][0].startswith("region 2/2 Block#2: lowered by fx") and seen[-1][1:] == (2, 2)
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)


@pytest.mark.parametrize("unit", ["blocks", "whole"])
@pytest.mark.parametrize("dynamic", [None, False])
def test_symbolic_captures_run_without_the_fake_dispatch_cache_static_ones_with_it(monkeypatch, unit, dynamic):
    before = dynamo_config.fake_tensor_cache_enabled
    real, seen = lowering_module.lower_graph, set()

    def lower(self, gm, example_inputs, *args, **kwargs):
        seen.update(fake_caches_of(gm, example_inputs))
        return real(self, gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(lowering_module, "lower_graph", lower)
    module, x = _net(), torch.randn(2, 8, 3, 5)
    with torch.no_grad():
        assert rel_err(_compile(module, mode="fast", compile_unit=unit, dynamic=dynamic)(x), module(x)) < 1e-6
    assert seen == ({False} if dynamic is None else {before})
    assert dynamo_config.fake_tensor_cache_enabled is before


def test_a_failed_region_runs_its_blocks_eagerly_and_the_others_stay_compiled(monkeypatch, caplog):
    fail_lowering_of_width(monkeypatch, 32)
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.fallback is None and info.compile_count == 1 and info.compiles[0].region == "Block#1"
    assert list(info.region_fallbacks) == ["Block#2"] and "lowering exploded" in info.region_fallbacks["Block#2"]
    assert "region Block#2 (2 block(s): wide.0...) compile failed" in caplog.text
    assert "the other regions stay compiled" in caplog.text and "REGION Block#2 RUNS EAGER" in info.summary()


def test_a_cancel_in_one_region_is_re_raised_and_the_next_call_compiles_only_what_is_missing():
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="fast")

    def cancel(what, done, total):
        if "Block#2" in what:
            raise Cancelled("cancelled by the user")

    compiled.progress = cancel
    settings = (fx_config.use_duck_shape, dynamo_config.fake_tensor_cache_enabled, dynamo.recompile_limit())
    with torch.no_grad(), pytest.raises(Cancelled, match="cancelled by the user"):
        compiled(x)
    assert (fx_config.use_duck_shape, dynamo_config.fake_tensor_cache_enabled, dynamo.recompile_limit()) == settings
    info = kiln.stats(compiled)
    assert info.fallback is None and not info.region_fallbacks and [c.region for c in info.compiles] == ["Block#1"]
    compiled.progress = None  # the next prompt
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
    assert [c.region for c in info.compiles] == ["Block#1", "Block#2"] and not info.region_fallbacks


def test_blocks_run_as_before_outside_kiln_s_call():
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        compiled(x)
        assert all(block._compiled_call_impl is None for block in (*module.blocks, *module.wide))
        before = kiln.stats(compiled).compile_count
        module(x)  # the original module, called directly: eager, nothing compiled
    assert kiln.stats(compiled).compile_count == before


def test_compile_unit_whole_compiles_one_graph():
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, compile_unit="whole")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.regions == [] and info.compile_count == 1 and info.compiles[0].region == ""


def test_compile_unit_option():
    assert CompileOptions().compile_unit == "auto"
    with pytest.raises(OptionsError, match="compile_unit='regions': use one of auto, blocks, whole"):
        CompileOptions(compile_unit="regions")
    assert CompileOptions(compile_unit="blocks", shapes={"pin": ["512x512"]}).pins_shapes  # specialised per region
    options = CompileOptions(shapes={"pin": ["512x512"]})  # auto with pins: the whole model, said in the log
    assert options.pins_shapes and options.compile_unit == "auto"


def test_auto_with_pinned_shapes_compiles_whole_and_by_blocks_says_they_wait_for_their_first_call(caplog):
    caplog.set_level("INFO", logger="kiln")
    compiled = _compile(_net(), mode="balanced", shapes={"specialize": "pinned", "pin": ["64x64"]})
    compiled._prepare()
    assert kiln.stats(compiled).regions == [] and "compiles whole: pinned shapes are compiled ahead" in caplog.text
    compiled = _compile(_net(), mode="balanced", compile_unit="blocks", shapes={"pin": ["64x64"]})
    compiled._prepare()
    assert len(kiln.stats(compiled).regions) == 2
    assert "each pinned shape gets static variants of the regions' graphs when the model first runs at it" in caplog.text


def _variants(compiled) -> list[tuple[str, str, str]]:
    return [(v.how, v.note, v.signature) for v in kiln.stats(compiled).variants]


def test_by_blocks_a_pinned_shape_gets_static_variants_of_each_region_when_the_model_first_runs_at_it():
    module = _net()
    compiled = _compile(module, mode="balanced", compile_unit="blocks", shapes={"pin": ["64x64"]})
    other, pinned = torch.randn(2, 8, 3, 5), torch.randn(2, 8, 8, 8)  # 64x64 px: an 8x8 latent
    with torch.no_grad():
        assert rel_err(compiled(other), module(other)) < 1e-5
        assert [how for how, _, _ in _variants(compiled)] == ["compiled", "compiled"]  # a region graph each
        assert rel_err(compiled(pinned), module(pinned)) < 1e-5
        specialised = [v for v in kiln.stats(compiled).variants if v.how == "specialised"]
        assert [(v.graph, v.note) for v in specialised] == [(0, "pinned"), (1, "pinned")]
        assert specialised[0].signature == ("inputs 2x64x16, float32 cpu, in the model at batch 2, latent 8x8 "
                                            "(64x64 px)")
        assert rel_err(compiled(pinned), module(pinned)) < 1e-5  # the static variants run it now
        assert [v.calls for v in specialised] == [12, 4]  # six and two blocks a call, twice
        wider = torch.randn(3, 8, 8, 8)  # another batch at the pinned size: the pin is for the first call's batch
        assert rel_err(compiled(wider), module(wider)) < 1e-5
    info = kiln.stats(compiled)
    assert [v.how for v in info.variants[-2:]] == ["reused", "reused"]
    assert info.compile_count == 2 and info.eager_calls == 0  # TorchDynamo captured nothing again


def test_by_blocks_a_bucket_shape_sampled_first_gets_its_static_variants_from_the_next_block_call():
    module = _net()
    compiled = _compile(module, mode="balanced", shapes={"specialize": "buckets", "buckets": [[64, 64]]})
    bucket = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        assert rel_err(compiled(bucket), module(bucket)) < 1e-5
        assert rel_err(compiled(bucket), module(bucket)) < 1e-5
    info = kiln.stats(compiled)
    assert len(info.regions) == 2  # auto compiles by blocks with buckets: they wait for their first call anyway
    # each graph's first block call ran the lowering it was captured for, every later one its static
    # variant (Block#1 serves six blocks a call, Block#2 two)
    assert [(v.graph, v.how, v.note, v.calls) for v in info.variants] == [
        (0, "compiled", "", 1), (0, "specialised", "resolution bucket", 11),
        (1, "compiled", "", 1), (1, "specialised", "resolution bucket", 3)]


class TwoDepthNet(torch.nn.Module):
    """Four identical blocks, two on the image's tokens and two on every other token: one region whose
    graph sees two sizes in every call, as SD1.5's deepest blocks do."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(4))

    def forward(self, image):
        x = self.embed(image.flatten(2).transpose(1, 2))
        for i, block in enumerate(self.blocks):
            x = block(x[:, ::2] if i == 2 else x)
        return x


def test_a_region_at_two_depths_keeps_the_static_variants_of_the_shape_under_way_whatever_max_variants():
    torch.manual_seed(0)
    module, bucket = TwoDepthNet().eval(), torch.randn(2, 8, 8, 8)
    compiled = _compile(module, mode="balanced", shapes={"specialize": "buckets", "buckets": [[64, 64]], "max_variants": 1})
    with torch.no_grad():
        for _ in range(3):  # evicting one depth's variant for the other's would lower them again at every call
            assert rel_err(compiled(bucket), module(bucket)) < 1e-5
    info = kiln.stats(compiled)
    assert [(v.how, v.signature.split(",")[0]) for v in info.variants] == [
        ("compiled", "inputs 2x64x16"), ("specialised", "inputs 2x64x16"), ("specialised", "inputs 2x32x16")]
    assert info.evictions == 0


def test_a_model_called_without_a_latent_says_its_regions_get_no_static_variants(caplog):
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(16) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    module, tokens = Tokens().eval(), torch.randn(2, 64, 16)
    compiled = _compile(module, mode="balanced", shapes={"specialize": "buckets", "buckets": [[64, 64]]})
    with torch.no_grad():
        assert rel_err(compiled(tokens), module(tokens)) < 1e-5
        compiled(tokens)
    info = kiln.stats(compiled)
    assert [v.how for v in info.variants] == ["compiled"]
    notes = [w for w in info.warnings if "no 4-D or 5-D latent" in w]
    assert len(notes) == 1 and "its regions get no static variants" in caplog.text


def test_a_model_without_repeated_blocks_compiles_whole_under_auto_and_says_so_under_blocks(caplog):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(8), torch.nn.Linear(8, 8)])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x))

    auto = _compile(Two(), mode="fast")
    auto._prepare()
    assert kiln.stats(auto).regions == []
    blocks = _compile(Two(), compile_unit="blocks")
    with torch.no_grad():
        blocks(torch.randn(2, 8))
    assert [r.name for r in kiln.stats(blocks).regions] == ["Block#1"]


def test_the_cache_stores_one_entry_per_region_and_a_new_process_loads_them(tmp_path):
    x = torch.randn(2, 8, 3, 5)
    first = _compile(_net(), mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        first(x)
    assert [e.outcome for e in kiln.stats(first).cache] == ["miss", "miss"]
    module = _net()  # another model object with the same blocks: what a restarted server has
    second = _compile(module, mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(second(x), module(x)) < 1e-5
    info = kiln.stats(second)
    assert [e.outcome for e in info.cache] == ["hit", "hit"] and [c.region for c in info.compiles] == ["Block#1", "Block#2"]


def test_kiln_s_passes_run_on_each_region_s_graph():
    """SDXL's layout (its transformer blocks split into identical BasicTransformerBlocks): every GEGLU
    of one block of each region is rewritten; the other blocks of a region run that same graph."""
    from kiln.testing.models import MODELS

    spec = MODELS["sdxl"]
    unet = spec.build("tiny")
    args, kwargs = spec.inputs(unet, batch=2)
    compiled = _compile(unet, passes={"fuse_geglu": "on"})
    with torch.no_grad():
        assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-5
    info = kiln.stats(compiled)
    per_region = [sum(type(m).__name__ == "GEGLU" for m in unet.get_submodule(r.members[0]).modules()) for r in info.regions]
    assert sum(per_region) > 0 and info.pass_counts["fuse_geglu"] == sum(per_region)
    assert any(len(r.members) > 1 for r in info.regions if r.name.startswith("BasicTransformerBlock"))


class Down(torch.nn.Module):
    """One convolution: Inductor has nothing to fuse in it."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class Mix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.conv = torch.nn.GroupNorm(2, 4), torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return x + self.conv(torch.nn.functional.silu(self.norm(x)))


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Mix(), Down(), Mix(), Down()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_region_with_nothing_to_fuse_runs_eagerly_and_says_why():
    torch.manual_seed(0)
    module = ConvNet().eval()
    compiled = _compile(module, mode="balanced")
    with torch.no_grad():
        for shape in ((2, 4, 8, 8), (2, 4, 8, 8), (3, 4, 6, 10)):  # batch 2 first: TorchDynamo specialises a 1
            x = torch.randn(shape)
            assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    assert info.regions_eager == {"Down#1": "nothing for Inductor to fuse (conv2d)"}
    assert [(c.region, c.lowering) for c in info.compiles] == [("Mix#1", "inductor"), ("Down#1", "eager")]
    assert info.eager_calls == 0 and not info.region_fallbacks
    assert "1 region(s) eager by choice (1 nothing to fuse)" in info.units_line()
    assert "region Down#1 runs eagerly by choice: nothing for Inductor to fuse (conv2d)" in info.summary()


def test_the_verdict_is_kept_in_the_cache_and_a_new_process_runs_the_region_eagerly_without_capturing_it(
        tmp_path, caplog):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        first = _compile(ConvNet().eval(), mode="balanced", cache_dir=str(tmp_path))
        first(x)
        module = ConvNet().eval()  # another model object with the same blocks: what a restarted server has
        second = _compile(module, mode="balanced", cache_dir=str(tmp_path))
        assert rel_err(second(x), module(x)) < 1e-5
    assert [(c.region, c.lowering) for c in kiln.stats(first).compiles] == [("Mix#1", "inductor"), ("Down#1", "eager")]
    info = kiln.stats(second)
    assert [c.region for c in info.compiles] == ["Mix#1"]  # Down#1 not captured
    assert info.regions_eager == {"Down#1": "nothing for Inductor to fuse (conv2d) (found before, from Kiln's cache)"}
    assert "1 region(s) eager by choice (1 nothing to fuse)" in info.units_line()

    from kiln.compiler.cache import CacheOptions, GraphCache
    from kiln.compiler.regional.fusible import IDLE_FILE

    cache = GraphCache(CacheOptions(dir=str(tmp_path)))
    records = [e for _, e, _ in cache.store().headers() if e is not None and "region_choice" in e.fields]
    assert len(records) == 1
    cache.write_record(records[0].fields, IDLE_FILE, b'{"ops": ["silu", "add"]}')  # signed, yet not a verdict
    caplog.set_level(logging.WARNING, logger="kiln")
    third = _compile(ConvNet().eval(), mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        third(x)
    assert "ignored the stored verdict of region Down#1" in caplog.text and "captured again" in caplog.text
    assert [c.region for c in kiln.stats(third).compiles] == ["Mix#1", "Down#1"]
    assert kiln.stats(third).regions_eager == {"Down#1": "nothing for Inductor to fuse (conv2d)"}


def test_when_the_regions_with_something_to_fuse_all_fail_the_model_says_it_runs_eagerly(monkeypatch, caplog):
    def broken_lowering(*args, **kwargs):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(lowering_module, "lower_graph", broken_lowering)
    module, x = ConvNet().eval(), torch.randn(2, 4, 8, 8)
    compiled = _compile(module, mode="balanced")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert list(info.region_fallbacks) == ["Mix#1"] and list(info.regions_eager) == ["Down#1"]
    assert info.fallback.startswith("no block region is compiled: 1 failed, 1 run eagerly by choice")
    assert "lowering exploded" in info.fallback and "runs eagerly from now on" in caplog.text


def test_regions_with_nothing_to_fuse_are_lowered_where_lowering_pays_anyway():
    from kiln.compiler.backend.context import CompileUnit
    from kiln.compiler.regional.regional_compile import may_stay_eager

    def may_keep_eager(device="cpu", **options):
        return may_stay_eager(CompileOptions(**options), device)

    assert may_keep_eager(mode="balanced")
    assert not may_keep_eager(mode="max")  # autotuning may pick a generated convolution
    assert not may_keep_eager(mode="balanced", inductor={"max_autotune": True})
    assert not may_keep_eager("cuda", mode="balanced", cuda_graphs=True)  # a CUDA graph pays on any graph
    assert may_keep_eager("cpu", mode="balanced", cuda_graphs=True)
    assert may_keep_eager(mode="fast")  # the graph runs as captured either way: without TorchDynamo's entry, eagerly
    assert not may_keep_eager("cuda", mode="fast", cuda_graphs=True)
    assert CompileUnit().as_captured is None and CompileUnit().is_whole_model  # a whole model lowers every graph


def test_a_region_torchdynamo_cannot_capture_runs_eagerly_and_the_others_stay_compiled(monkeypatch, caplog):
    """TorchDynamo's own error while capturing (not the backend's): ComfyUI 0.33's fp8 activations on torch 2.14
    raise "AssertionError: Expect size to be a plain tuple of ints" from its input wrapping. Before, that failed the
    prompt; now the region runs eagerly and says why."""
    from torch._dynamo.output_graph import OutputGraph

    real = OutputGraph.compile_and_call_fx_graph

    def capture(self, tx, rvals, root, *args, **kwargs):
        if any(isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] == 32 for v in self.example_inputs()):
            raise AssertionError("Expect size to be a plain tuple of ints but got torch.Size([s31, s81])")
        return real(self, tx, rvals, root, *args, **kwargs)

    monkeypatch.setattr(OutputGraph, "compile_and_call_fx_graph", capture)
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="fast")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.fallback is None and [c.region for c in info.compiles] == ["Block#1"]
    assert "AssertionError: Expect size to be a plain tuple of ints" in info.region_fallbacks["Block#2"]
    assert "region Block#2 (2 block(s): wide.0...) compile failed" in caplog.text


def test_the_models_own_error_still_reaches_the_user():
    """A shape error TorchDynamo meets while capturing counts as a failed capture (Kiln cannot tell it from
    TorchDynamo's own), so the model runs eagerly: and there the error is raised as the model raises it."""
    class Broken(torch.nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)  # x is (2, 5): the model's own shape error

    compiled = _compile(Broken(), mode="fast")
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        compiled(torch.randn(2, 5))


def test_with_cuda_graphs_every_regions_graph_runs_under_the_models_input_shape(monkeypatch):
    """shapes.max_cuda_graphs counts the model's input shapes, not graphs (compiler/shapes/cuda_graph_budget.py):
    each region's graph runs inside the model call's place. CUDA graphs need a GPU (tests/gpu); here the
    budget is handed the CPU graphs to check what it is asked with."""
    from kiln.compiler.backend.context import ModelContext
    from kiln.compiler.shapes.cuda_graph_budget import CudaGraphBudget

    seen = []

    def run(self, record, fn, args):
        seen.append((record.graph, self._call_shape))
        return fn(*args)

    monkeypatch.setattr(CudaGraphBudget, "run", run)
    monkeypatch.setattr(ModelContext, "budget_for", lambda self, device: self.cuda_graph_budget)
    module = _net()
    compiled = _compile(module, mode="fast", cuda_graphs=True)
    with torch.no_grad():
        for shape in ((2, 8, 3, 5), (3, 8, 4, 4)):
            seen.clear()
            x = torch.randn(*shape)
            assert rel_err(compiled(x), module(x)) < 1e-6
            assert sorted({graph for graph, _ in seen}) == [0, 1] and len(seen) == 8  # 8 blocks, 2 region graphs
            assert {call_shape for _, call_shape in seen} == {(shape,)}


class DownNet(torch.nn.Module):
    """Two identical blocks with nothing for Inductor to fuse: one region, run eagerly by choice."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Down(), Down()])

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def test_once_every_region_runs_eagerly_a_call_skips_the_routing(monkeypatch):
    entered = []
    routed = kiln.compiler.torch_compat.module_calls.calls_routed

    def counting(routes):
        entered.append(len(routes))
        return routed(routes)

    monkeypatch.setattr(kiln.compiler.torch_compat.module_calls, "calls_routed", counting)
    torch.manual_seed(0)
    module, x = DownNet().eval(), torch.randn(2, 4, 8, 8)
    compiled = _compile(module, mode="balanced")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6  # the first call decides: nothing to fuse
        assert entered == [2]  # one route per block
        y = torch.randn(3, 4, 6, 6)
        assert rel_err(compiled(x), module(x)) < 1e-6 and rel_err(compiled(y), module(y)) < 1e-6
    assert entered == [2]  # the later calls ran the model as it is
    info = kiln.stats(compiled)
    assert list(info.regions_eager) == ["Down#1"] and info.fallback is None


def test_a_model_with_a_compiled_region_keeps_routing_every_call(monkeypatch):
    entered = []
    routed = kiln.compiler.torch_compat.module_calls.calls_routed
    monkeypatch.setattr(kiln.compiler.torch_compat.module_calls, "calls_routed", lambda routes: entered.append(1) or routed(routes))
    torch.manual_seed(0)
    module, x = ConvNet().eval(), torch.randn(2, 4, 8, 8)  # Mix compiles, Down runs eagerly
    compiled = _compile(module, mode="balanced")
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(compiled(x), module(x)) < 1e-5
    assert len(entered) == 3
