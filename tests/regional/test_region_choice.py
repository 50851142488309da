"""Compiled or eager per region, by measurement (compiler/regional/region_choice.py), and the choice kept in the cache."""
import logging
import math

import pytest
import torch

import kiln
from kiln.compiler import CompileOptions, OptionsError, cpu
from kiln.compiler.cpu import region_rules
from kiln.compiler.regional import gpu_time, region_choice
from kiln.compiler.regional.region_choice import MIN_GAIN, RegionTiming, fresh_copies, time_both, why_not_measured
from testing_utils import rel_err


class Mix(torch.nn.Module):
    """A norm, an activation and a layer mixing the channels of each pixel (a Linear: on a CPU a
    block of convolutions is not compiled at all, `cpu.eager_before_capture`)."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.norm, self.mix = torch.nn.GroupNorm(2, channels), torch.nn.Linear(channels, channels)

    def forward(self, x):
        h = torch.nn.functional.silu(self.norm(x))
        return x + self.mix(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class InPlace(torch.nn.Module):
    """Updates its input in place and returns it, as ComfyUI's Flux blocks do with `img`."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

    def forward(self, x):
        x += torch.nn.functional.gelu(self.fc(self.norm(x)))
        return x


class Net(torch.nn.Module):
    """Two identical Mix blocks (region Mix#1) and two of another width (Mix#2)."""

    def __init__(self):
        super().__init__()
        self.narrow = torch.nn.ModuleList([Mix(4), Mix(4)])
        self.widen = torch.nn.Conv2d(4, 8, 1)
        self.wide = torch.nn.ModuleList([Mix(8), Mix(8)])

    def forward(self, x):
        for block in self.narrow:
            x = block(x)
        x = self.widen(x)
        for block in self.wide:
            x = block(x)
        return x


class InPlaceNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([InPlace(), InPlace(), InPlace()])

    def forward(self, x):
        x = x * 1.0
        for block in self.blocks:
            x = block(x)
        return x


def _net():
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def timings(monkeypatch):
    """time_both answering, per region in call order, the timings listed (compiled ms, eager ms);
    the calls it was given still run once each, so what they do is checked too."""
    answers: list[tuple[float, float]] = []

    def fake(compiled, eager, args, kwargs, device, rounds=region_choice.ROUNDS):
        compiled(*fresh_copies(args, kwargs))
        eager(*fresh_copies(args, kwargs))
        return RegionTiming(*answers.pop(0))

    monkeypatch.setattr(region_choice, "time_both", fake)
    return answers


# ---- the rule and the record ---------------------------------------------------------------------

def test_a_region_stays_compiled_only_when_it_is_min_gain_faster():
    assert RegionTiming(compiled_ms=0.9, eager_ms=1.0).compiled_pays
    assert RegionTiming(compiled_ms=1.0 - MIN_GAIN, eager_ms=1.0).compiled_pays
    assert not RegionTiming(compiled_ms=0.99, eager_ms=1.0).compiled_pays
    assert not RegionTiming(compiled_ms=1.2, eager_ms=1.0).compiled_pays
    assert RegionTiming(0.9, 1.0).reason() == ""
    why = RegionTiming(1.2, 1.0).reason()
    assert "compiled 1.200 ms, eager 1.000 ms a call (0.83x)" in why and "3% faster" in why


def test_a_stored_timing_reads_back_and_a_bad_one_is_refused_naming_the_field():
    timing = RegionTiming(1.25, 2.5)
    assert RegionTiming.from_bytes(timing.to_bytes(), "here") == timing
    bad = {
        b"not json": "not JSON",
        b'{"compiled_ms": 1.0}': "exactly the fields",
        b'{"compiled_ms": 1.0, "eager_ms": 2.0, "run": "rm -rf /"}': "exactly the fields",
        b'{"compiled_ms": -1.0, "eager_ms": 2.0}': "compiled_ms=-1.0",
        b'{"compiled_ms": 1.0, "eager_ms": NaN}': "eager_ms=nan",
        b'{"compiled_ms": true, "eager_ms": 2.0}': "compiled_ms=True",
        b'{"compiled_ms": "1", "eager_ms": 2.0}': "compiled_ms=1",
        b'[1.0, 2.0]': "exactly the fields",
        b" " * 2000: "more than a region timing's",
        b"[" * 1000: "not JSON",  # nested past Python's recursion limit: RecursionError inside json
    }
    for data, said in bad.items():
        with pytest.raises(ValueError, match="the stored choice") as caught:
            RegionTiming.from_bytes(data, "the stored choice")
        assert said in str(caught.value)


def test_fresh_copies_keep_strides_and_kind_and_copy_dicts_one_level():
    x = torch.randn(2, 4, 3, 5).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        y = torch.randn(3)
        options = {"block": ("input", 1), "scale": 0.5, "t": y}
        args, kwargs = fresh_copies((x, 7), {"transformer_options": options})
    assert args[0] is not x and torch.equal(args[0], x) and args[0].stride() == x.stride()
    assert not args[0].is_inference() and args[1] == 7
    copied = kwargs["transformer_options"]
    assert copied is not options and copied["t"] is not y and copied["t"].is_inference() and copied["scale"] == 0.5


def test_time_both_gives_each_call_its_own_copies_and_alternates_the_order(monkeypatch):
    x = torch.zeros(3)
    order = []

    def compiled(args, kwargs):
        args[0].add_(1)  # in place: must not reach the caller's tensor
        order.append("c")

    def eager(args, kwargs):
        args[0].add_(1)
        order.append("e")

    monkeypatch.setattr(region_rules, "MAX_CPU_CALLS", 1)
    timing = time_both(compiled, eager, (x,), {}, "cpu", rounds=4)
    assert torch.equal(x, torch.zeros(3)) and order == ["c", "e"] + ["c", "e", "e", "c", "c", "e", "e", "c"]  # warm-up
    assert timing.compiled_ms > 0 and timing.eager_ms > 0


def test_on_a_cpu_a_sample_is_as_many_calls_as_outlast_the_noise(monkeypatch):
    """After one call of each side (the warm-up), sized by its eager call: MIN_SAMPLE_MS of calls a sample,
    at most MAX_CPU_CALLS."""
    assert region_choice.calls_per_sample("cpu", 1 << 20, call_ms=50.0) == 1
    assert region_choice.calls_per_sample("cpu", 1 << 20, call_ms=region_rules.MIN_SAMPLE_MS / 4) == 4
    assert region_choice.calls_per_sample("cpu", 1 << 20, call_ms=0.0) == region_rules.MAX_CPU_CALLS
    assert region_choice.calls_per_sample("cpu", region_rules.CPU_COPIES_BYTES // 3, call_ms=0.0) == 3  # copies fit
    assert region_choice.calls_per_sample("cpu", 1 << 40, call_ms=0.0) == 1  # never fewer than one
    assert region_choice.calls_per_sample("mps", 1 << 20, call_ms=0.0) == 1  # another device: one call, as before
    order = []
    clock = iter(range(0, 10_000, 1))  # each reading 1 ms after the last...
    monkeypatch.setattr(region_choice.time, "perf_counter", lambda: next(clock) / 1e3)
    timing = time_both(lambda a, k: order.append("c"), lambda a, k: order.append("e"), (torch.zeros(3),), {}, "cpu",
                       rounds=2)
    n = math.ceil(region_rules.MIN_SAMPLE_MS)  # ... so the warm-up's eager call reads 1 ms
    assert order == ["c", "e"] + ["c"] * n + ["e"] * n + ["e"] * n + ["c"] * n
    assert timing.compiled_ms == pytest.approx(1 / n) and timing.eager_ms == pytest.approx(1 / n)


def test_on_a_gpu_a_sample_is_calls_issued_back_to_back(monkeypatch):
    """A step issues a block's work while the GPU runs the blocks before it, so on a GPU a sample is
    PIPELINED_CALLS calls between two synchronisations, each on its own copies."""
    syncs, order = [], []
    monkeypatch.setattr(gpu_time, "_sync", lambda device: syncs.append(len(order) - 2))  # after the warm-up's 2
    monkeypatch.setattr(region_choice, "_free_gpu_bytes", lambda: 1 << 40)
    clock = iter(range(0, 10_000, 10))  # each reading 10 s after the last: a sample of n calls reads 10 s
    monkeypatch.setattr(region_choice.time, "perf_counter", lambda: next(clock))
    x = torch.zeros(3)

    def compiled(args, kwargs):
        args[0].add_(1)
        order.append(("c", args[0]))

    def eager(args, kwargs):
        order.append(("e", args[0]))

    timing = time_both(compiled, eager, (x,), {}, "cuda", rounds=2, clock=gpu_time.WallClock("cuda"))
    n = region_choice.PIPELINED_CALLS
    assert n > 1 and [name for name, _ in order] == ["c", "e"] + ["c"] * n + ["e"] * n + ["e"] * n + ["c"] * n
    assert syncs == [0, n, n, 2 * n, 2 * n, 3 * n, 3 * n, 4 * n]  # around each sample's calls, not each call
    assert len({id(t) for _, t in order}) == 4 * n + 2 and torch.equal(x, torch.zeros(3))
    assert timing.compiled_ms == timing.eager_ms == 10_000 / n  # a sample's time over its calls, in ms


def test_on_a_gpu_the_copies_of_big_inputs_fit_a_share_of_its_free_memory(monkeypatch):
    monkeypatch.setattr(region_choice, "_free_gpu_bytes", lambda: 8 << 30)  # 8 GiB free: 2 GiB for copies
    assert region_choice.calls_per_sample("cuda", 64 << 20, 0.0) == region_choice.PIPELINED_CALLS
    assert region_choice.calls_per_sample("cuda", 700 << 20, 0.0) == 2
    assert region_choice.calls_per_sample("cuda", 5 << 30, 0.0) == 1  # never fewer than one
    args = (torch.zeros(4, 8), {"transformer_options": True, "mask": torch.zeros(2, dtype=torch.float16)})
    assert region_choice.input_bytes(args, {"context": torch.zeros(3)}) == 4 * 8 * 4 + 2 * 2 + 3 * 4


def test_a_region_whose_measuring_runs_out_of_gpu_memory_stays_compiled_and_says_why(monkeypatch, caplog):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(region_choice, "time_both", out_of_memory)
    module = _net()
    compiled = kiln.compile(module, mode="balanced")
    x = torch.randn(2, 4, 8, 8)
    with caplog.at_level(logging.WARNING, logger="kiln"), torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    assert not info.region_timings and not info.region_fallbacks and info.compile_count == 2
    assert any("ran out of memory" in r.getMessage() and "stays compiled" in r.getMessage() for r in caplog.records)


def test_blocks_with_hooks_or_patches_are_not_measured():
    block = Mix()
    assert why_not_measured(block, patched=False) == ""
    assert "patches" in why_not_measured(block, patched=True)
    handle = block.mix.register_forward_hook(lambda module, args, out: None)
    assert why_not_measured(block, patched=False) == "mix has forward hooks"
    handle.remove()
    block.register_forward_pre_hook(lambda module, args: None)
    assert why_not_measured(block, patched=False) == "the block has forward hooks"


def test_measure_regions_is_an_option_checked_by_name():
    assert CompileOptions().measure_regions is True
    assert CompileOptions(measure_regions=False).as_dict()["measure_regions"] is False
    with pytest.raises(OptionsError, match="measure_regions"):
        CompileOptions(measure_regions="yes")
    from kiln.compiler.options.compile_options import parse_expert_options

    assert parse_expert_options("measure_regions: false") == {"measure_regions": False}


# ---- by blocks -------------------------------------------------------------------------------------

def test_a_region_measured_slower_compiled_runs_its_blocks_eagerly_and_says_why(timings, caplog):
    timings += [(0.5, 1.0), (2.0, 1.0)]  # Mix#1 faster compiled, Mix#2 slower
    module = _net()
    compiled = kiln.compile(module, mode="balanced")
    caplog.set_level(logging.INFO, logger="kiln")
    with torch.no_grad():
        for shape in ((2, 4, 8, 8), (2, 4, 8, 8), (3, 4, 6, 10)):
            x = torch.randn(shape)
            assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    assert list(info.regions_eager) == ["Mix#2"] and "measured no faster compiled" in info.regions_eager["Mix#2"]
    assert set(info.region_timings) == {"Mix#1", "Mix#2"}
    assert [c.region for c in info.compiles] == ["Mix#1", "Mix#2"] and not info.recompiles  # a new size: nothing
    assert "1 region(s) eager by choice (1 measured no faster compiled)" in info.units_line()
    assert "region Mix#2 runs eagerly by choice: measured no faster compiled (compiled 2.000 ms" in info.summary()
    assert "region Mix#1 stays compiled: compiled 0.500 ms, eager 1.000 ms a call (2.00x)" in info.summary()
    assert "region Mix#2 runs eagerly: measured no faster compiled" in caplog.text


def test_the_real_timing_decides_and_the_output_is_eager_s():
    module, x = _net(), torch.randn(2, 4, 8, 8)
    compiled = kiln.compile(module, mode="balanced")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
        assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    # Mix#2 is measured unless Mix#1, the first of its class, measured slower (then it is not compiled)
    assert "Mix#1" in info.region_timings and info.eager_calls == 0
    assert ("Mix#2" in info.region_timings) == info.region_timings["Mix#1"].gains(0.0)
    for name, timing in info.region_timings.items():
        assert timing.compiled_ms > 0 and timing.eager_ms > 0
        assert (name in info.regions_eager) == (not timing.compiled_pays)


def test_measuring_a_block_that_updates_its_input_in_place_changes_nothing():
    torch.manual_seed(0)
    module, x = InPlaceNet().eval(), torch.randn(2, 5, 8)
    compiled = kiln.compile(module, mode="balanced")
    with torch.no_grad():
        expected = module(x.clone())
        assert rel_err(compiled(x.clone()), expected) < 1e-5
    assert list(kiln.stats(compiled).region_timings) == ["InPlace#1"]


def test_when_no_region_pays_the_line_says_the_model_runs_as_it_does_eagerly(timings):
    timings += [(2.0, 1.0)]  # Mix#1; Mix#2, of its class, is then not compiled
    module, x = _net(), torch.randn(2, 4, 8, 8)
    compiled = kiln.compile(module, mode="balanced")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    assert info.fallback is None and info.units_line().endswith(
        "2 region(s) eager by choice (1 measured no faster compiled, 1 not compiled after their class's first); "
        "no region is faster compiled here, "
        "so the model runs as it does eagerly")


def test_measure_regions_false_keeps_every_region_with_something_to_fuse_compiled(timings):
    timings += [(2.0, 1.0), (2.0, 1.0)]
    module, x = _net(), torch.randn(2, 4, 8, 8)
    compiled = kiln.compile(module, options=CompileOptions(measure_regions=False))
    with torch.no_grad():
        compiled(x)
    info = kiln.stats(compiled)
    assert not info.regions_eager and not info.region_timings and len(timings) == 2


class Res(torch.nn.Module):
    """A ResNet-like block: most of its weights are in its convolutions."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, channels)
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.emb = torch.nn.Linear(channels, channels)

    def forward(self, x):
        h = self.conv(torch.nn.functional.silu(self.norm(x)))
        return x + h + self.emb(h.mean((2, 3)))[:, :, None, None]


class ResNet(torch.nn.Module):
    """Two Res blocks (region Res#1) and two Mix blocks (Mix#1)."""

    def __init__(self):
        super().__init__()
        self.res = torch.nn.ModuleList([Res(), Res()])
        self.mix = torch.nn.ModuleList([Mix(), Mix()])

    def forward(self, x):
        for block in (*self.res, *self.mix):
            x = block(x)
        return x


def test_the_share_of_a_block_s_weights_in_convolutions():
    res = Res()
    conv = res.conv.weight.numel() + res.conv.bias.numel()
    total = sum(p.numel() for p in res.parameters())
    assert region_rules.convolution_share(res) == conv / total and conv / total > region_rules.CPU_CONVOLUTION_SHARE
    assert region_rules.convolution_share(Mix()) == 0.0
    assert region_rules.convolution_share(torch.nn.ReLU()) == 0.0  # no weights at all

    class SubclassConv(torch.nn.Conv2d):  # as diffusers' and ComfyUI's convolutions are
        pass

    assert region_rules.convolution_share(SubclassConv(2, 2, 3)) == 1.0


def test_on_a_cpu_convolution_blocks_are_neither_captured_nor_measured_and_say_why(timings, caplog):
    timings += [(0.5, 1.0)]  # Mix#1 only: the Res blocks are never timed
    module, x = ResNet().eval(), torch.randn(2, 4, 8, 8)
    compiled = kiln.compile(module, mode="balanced")
    caplog.set_level(logging.INFO, logger="kiln")
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    assert not timings and list(info.region_timings) == ["Mix#1"]
    assert [c.region for c in info.compiles] == ["Mix#1"]  # Res#1 was not even captured
    assert info.eager_kinds == {"Res#1": "convolutions"}
    share = region_rules.convolution_share(module.res[0])
    assert info.regions_eager["Res#1"] == (f"not compiled: on a CPU, a block with {share:.0%} of its weights in "
                                           "convolutions; such blocks measured no faster compiled there, and each "
                                           "costs seconds to lower")
    assert "1 region(s) eager by choice (1 convolution blocks on a CPU)" in info.units_line()
    assert "region Res#1 runs eagerly: not compiled: on a CPU, a block with" in caplog.text


def test_convolution_blocks_compile_with_measure_regions_false_or_a_choice_measured_before(
        timings, tmp_path, monkeypatch):
    x = torch.randn(2, 4, 8, 8)
    every = kiln.compile(ResNet().eval(), options=CompileOptions(measure_regions=False))
    with torch.no_grad():
        every(x)
    assert [c.region for c in kiln.stats(every).compiles] == ["Res#1", "Mix#1"]

    # a choice kept in Kiln's cache is this machine's own measurement: it decides before the rule
    with monkeypatch.context() as without_rule:
        without_rule.setattr(cpu, "eager_before_capture", lambda block, device: "")
        timings += [(0.5, 1.0), (0.5, 1.0)]  # Res#1, Mix#1: both faster compiled, both stored
        with torch.no_grad():
            kiln.compile(ResNet().eval(), mode="balanced", cache_dir=str(tmp_path))(x)
    assert not timings
    later = kiln.compile(ResNet().eval(), mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        later(x)
    info = kiln.stats(later)
    assert [c.region for c in info.compiles] == ["Res#1", "Mix#1"] and not info.regions_eager
    assert info.region_timings["Res#1"] == RegionTiming(0.5, 1.0)


def test_in_the_background_convolution_blocks_and_stored_choices_are_decided_before_any_input_is_held(
        timings, tmp_path, monkeypatch, caplog):
    from kiln.compiler.regional.background import LoweringThread

    handed = []
    real_submit = LoweringThread.submit

    def submit(self, name, job, ready, nbytes):
        handed.append(name)
        return real_submit(self, name, job, ready, nbytes)

    monkeypatch.setattr(LoweringThread, "submit", submit)
    x = torch.randn(2, 4, 8, 8)
    module = ResNet().eval()
    timings += [(2.0, 1.0)]  # Mix#1, measured by its call after its lowering; the Res blocks are never timed
    compiled = kiln.compile(module, options=CompileOptions(mode="balanced", background=True), cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
        assert kiln.wait_lowered(compiled, timeout=60) == []
        compiled(x)
    info = kiln.stats(compiled)
    assert handed == ["Mix#1"] and not timings and [c.region for c in info.compiles] == ["Mix#1"]
    assert info.eager_kinds == {"Res#1": "convolutions", "Mix#1": "measured"}

    # a later start: Mix#1's choice, stored by that measurement, decides at its first call, on the
    # model's thread, as the rule does for Res#1: nothing is handed to the thread, nothing captured
    handed.clear()
    again = ResNet().eval()
    later = kiln.compile(again, options=CompileOptions(mode="balanced", background=True), cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(later(x), again(x)) < 1e-5
        assert kiln.wait_lowered(later, timeout=0) == []
    info = kiln.stats(later)
    assert handed == [] and info.compile_count == 0 and info.eager_kinds == {"Res#1": "convolutions",
                                                                           "Mix#1": "measured"}
    assert info.regions_eager["Mix#1"].endswith("(measured before, from Kiln's cache)")

    # a stored choice that is not a timing (too large, and no number), now read on the model's thread:
    # refused, said, and the region is handed in and measured again as if nothing were stored
    from kiln.compiler.cache import CacheOptions, GraphCache

    cache = GraphCache(CacheOptions(dir=str(tmp_path)))
    (fields,) = [entry.fields for _, entry, _ in cache.store().headers()
                 if entry is not None and "region_choice" in entry.fields and "Mix" in str(entry.fields)]
    cache.write_record(fields, region_choice.CHOICE_FILE, b'{"compiled_ms": "' + b"9" * 4096 + b'", "eager_ms": 1}')
    handed.clear()
    timings += [(0.5, 1.0)]
    caplog.set_level(logging.WARNING, logger="kiln")
    third = kiln.compile(ResNet().eval(), options=CompileOptions(mode="balanced", background=True),
                         cache_dir=str(tmp_path))
    with torch.no_grad():
        third(x)
        assert kiln.wait_lowered(third, timeout=60) == []
        third(x)
    assert "ignored the stored choice of region Mix#1" in caplog.text and "measured again" in caplog.text
    assert handed == ["Mix#1"] and not timings and kiln.stats(third).eager_kinds == {"Res#1": "convolutions"}


def test_a_block_with_a_hook_is_not_measured_and_stays_compiled(timings, caplog):
    timings += [(2.0, 1.0), (2.0, 1.0)]
    module, x = _net(), torch.randn(2, 4, 8, 8)
    for block in module.narrow:
        block.register_forward_hook(lambda m, args, out: None)
    compiled = kiln.compile(module, mode="balanced")
    caplog.set_level(logging.INFO, logger="kiln")
    with torch.no_grad():
        compiled(x)
    info = kiln.stats(compiled)
    assert list(info.region_timings) == ["Mix#2"] and list(info.regions_eager) == ["Mix#2"]
    assert "region Mix#1 is not measured against eager (the block has forward hooks); it stays compiled" in caplog.text


def test_the_choice_is_kept_in_the_cache_and_a_new_process_never_captures_a_slower_region(timings, tmp_path):
    timings += [(0.5, 1.0), (2.0, 1.0)]
    x = torch.randn(2, 4, 8, 8)
    first = kiln.compile(_net(), mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        first(x)
    assert [e.outcome for e in kiln.stats(first).cache] == ["miss", "miss"]
    from kiln.compiler.cache import CacheOptions, describe_cache

    assert "; 2 for Net (" in describe_cache(CacheOptions(dir=str(tmp_path)), "Net").text
    described = describe_cache(CacheOptions(dir=str(tmp_path)), "Net").text
    assert described.endswith(" and 2 region choice(s) (measured, or nothing to fuse).")
    module = _net()  # another model object with the same blocks: what a restarted server has
    second = kiln.compile(module, mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(second(x), module(x)) < 1e-5
    info = kiln.stats(second)
    assert not timings  # nothing measured again
    assert [c.region for c in info.compiles] == ["Mix#1"] and [e.outcome for e in info.cache] == ["hit"]
    assert info.regions_eager["Mix#2"].endswith("(measured before, from Kiln's cache)")
    assert info.region_timings == {"Mix#1": RegionTiming(0.5, 1.0), "Mix#2": RegionTiming(2.0, 1.0)}


def test_a_new_input_shape_or_refresh_measures_again(timings, tmp_path):
    timings += [(0.5, 1.0), (2.0, 1.0), (0.5, 1.0), (0.5, 1.0), (0.5, 1.0), (0.5, 1.0)]
    with torch.no_grad():
        kiln.compile(_net(), mode="balanced", cache_dir=str(tmp_path))(torch.randn(2, 4, 8, 8))
        other_size = kiln.compile(_net(), mode="balanced", cache_dir=str(tmp_path))
        other_size(torch.randn(2, 4, 6, 10))
        refreshed = kiln.compile(_net(), mode="balanced", cache_dir=str(tmp_path), cache="refresh")
        refreshed(torch.randn(2, 4, 8, 8))
    assert not timings
    assert not kiln.stats(other_size).regions_eager and not kiln.stats(refreshed).regions_eager


def test_a_stored_choice_that_is_not_a_timing_is_ignored_and_measured_again(timings, tmp_path, caplog):
    from kiln.compiler.cache import CacheOptions, GraphCache

    timings += [(0.5, 1.0), (2.0, 1.0), (0.5, 1.0), (0.5, 1.0)]
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        kiln.compile(_net(), mode="balanced", cache_dir=str(tmp_path))(x)
    cache = GraphCache(CacheOptions(dir=str(tmp_path)))
    store = cache.store()
    choices = [(key, entry) for key, entry, _ in store.headers() if entry is not None and "region_choice" in entry.fields]
    assert len(choices) == 2
    for key, entry in choices:  # signed with the user's key, yet not a timing: read as untrusted all the same
        cache.write_record(entry.fields, region_choice.CHOICE_FILE, b'{"compiled_ms": 1e999, "eager_ms": 1}')
    caplog.set_level(logging.WARNING, logger="kiln")
    second = kiln.compile(_net(), mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        second(x)
    assert "ignored the stored choice of region Mix#1" in caplog.text and "measured again" in caplog.text
    assert not timings and not kiln.stats(second).regions_eager


# ---- a class judged by its first regions ----------------------------------------------------------

class Tokens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(12), torch.nn.Linear(12, 12)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class Widths(torch.nn.Module):
    """Mix blocks of three widths (three regions of one class), then a block of another class."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.ModuleList([Mix(4), Mix(4), Mix(8), Mix(8), Mix(12), Mix(12)])
        self.widen = torch.nn.ModuleList([torch.nn.Conv2d(4, 8, 1), torch.nn.Conv2d(8, 12, 1)])
        self.tokens = torch.nn.ModuleList([Tokens(), Tokens()])

    def forward(self, x):
        x = self.mix[1](self.mix[0](x))
        x = self.mix[3](self.mix[2](self.widen[0](x)))
        x = self.mix[5](self.mix[4](self.widen[1](x)))
        t = x.flatten(2).transpose(1, 2)
        for block in self.tokens:
            t = block(t)
        return t


def test_a_class_whose_first_regions_gained_under_10_percent_together_is_judged_by_them():
    verdicts = region_choice.ClassVerdicts()
    assert verdicts.predicted_eager("Mix") == ""
    verdicts.record("Mix", "Mix#1", RegionTiming(0.9, 1.0))
    assert verdicts.predicted_eager("Mix") == ""  # one region that pays says too little
    verdicts.record("Mix", "Mix#2", RegionTiming(0.6, 1.0))
    assert verdicts.predicted_eager("Mix") == ""  # together 1.5 ms against 2.0: compiling pays
    marginal = region_choice.ClassVerdicts()
    marginal.record("Mix", "Mix#1", RegionTiming(0.8, 1.0))  # 1.25x alone: it stays compiled
    marginal.record("Mix", "Mix#2", RegionTiming(2.0, 2.0))
    assert "gained less than 10% compiled together (compiled 2.800 ms, eager 3.000 ms" in marginal.predicted_eager("Mix")
    slow = region_choice.ClassVerdicts()
    slow.record("Mix", "Mix#1", RegionTiming(0.95, 1.0))
    slow.record("Mix", "Mix#2", RegionTiming(1.1, 1.1))
    slow.record("Mix", "Mix#3", RegionTiming(0.1, 1.0))  # later ones do not change the verdict
    why = slow.predicted_eager("Mix")
    assert why.startswith("not compiled: the first 2 regions of its class (Mix#1, Mix#2) gained less than 10% "
                          "compiled together (compiled 2.050 ms, eager 2.100 ms a call (1.02x))")
    assert slow.predicted_eager("Tokens") == ""
    outlier = region_choice.ClassVerdicts()
    outlier.record("Mix", "Mix#1", RegionTiming(1.0, 3.0))  # one timing far off carries the sum past 10%...
    outlier.record("Mix", "Mix#2", RegionTiming(1.0, 1.01))
    assert outlier.predicted_eager("Mix") == (  # ... but not the class
        "not compiled: Mix#2, of the first 2 regions of its class (Mix#1, Mix#2), measured no faster compiled "
        "(compiled 1.000 ms, eager 1.010 ms a call (1.01x))")


def test_a_class_let_through_stops_at_its_first_later_region_that_measured_slower():
    """Its regions differ in size: the first two may gain while deeper ones lose."""
    verdicts = region_choice.ClassVerdicts()
    verdicts.record("Mix", "Mix#1", RegionTiming(0.8, 1.0))
    verdicts.record("Mix", "Mix#2", RegionTiming(0.85, 1.0))
    verdicts.record("Mix", "Mix#3", RegionTiming(1.0, 1.02))  # no faster, not slower: noise may say either
    assert verdicts.predicted_eager("Mix") == ""
    verdicts.record("Mix", "Mix#4", RegionTiming(1.1, 1.0))
    assert verdicts.predicted_eager("Mix") == (
        "not compiled: Mix#4, compiled after the first 2 regions of its class (Mix#1, Mix#2), measured slower "
        "compiled (compiled 1.100 ms, eager 1.000 ms a call (0.91x))")
    verdicts.record("Mix", "Mix#5", RegionTiming(0.5, 1.0))  # measured anyway (a stored choice): Mix#4 decides
    assert verdicts.predicted_eager("Mix").startswith("not compiled: Mix#4, compiled after")
    assert verdicts.predicted_eager("Tokens") == ""


def test_a_class_whose_first_region_measured_slower_is_judged_by_it():
    """Its next region would cost a lowering and, with the first, could gain 10% only by gaining far more alone."""
    verdicts = region_choice.ClassVerdicts()
    verdicts.record("Mix", "Mix#1", RegionTiming(1.05, 1.0))
    assert verdicts.predicted_eager("Mix") == ("not compiled: the first region of its class (Mix#1) measured "
                                               "slower compiled (compiled 1.050 ms, eager 1.000 ms a call (0.95x))")
    verdicts.record("Mix", "Mix#2", RegionTiming(0.1, 1.0))  # measured anyway (a stored choice): the first decides
    assert verdicts.predicted_eager("Mix").startswith("not compiled: the first region of its class (Mix#1)")
    close = region_choice.ClassVerdicts()  # no faster, not slower: one timing that close could be noise
    close.record("Mix", "Mix#1", RegionTiming(1.0, 1.0))
    assert close.predicted_eager("Mix") == ""


def test_the_other_regions_of_a_class_whose_first_gained_too_little_are_never_compiled(timings, tmp_path):
    timings += [(0.95, 1.0), (1.1, 1.1), (0.5, 1.0)]  # Mix#1, Mix#2, then Tokens#1 (Mix#3 is not compiled)
    torch.manual_seed(0)
    module, x = Widths().eval(), torch.randn(2, 4, 6, 6)
    compiled = kiln.compile(module, mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
        other = torch.randn(3, 4, 5, 7)  # a new size: nothing compiles, Mix#3 still eager
        assert rel_err(compiled(other), module(other)) < 1e-5
    info = kiln.stats(compiled)
    assert not timings and [c.region for c in info.compiles] == ["Mix#1", "Mix#2", "Tokens#1"]
    assert set(info.regions_eager) == {"Mix#2", "Mix#3"}
    assert info.regions_eager["Mix#3"].startswith("not compiled: the first 2 regions of its class (Mix#1, Mix#2)")
    assert "2 region(s) eager by choice (1 measured no faster compiled, 1 not compiled after their class's first)" \
        in info.units_line()
    again = kiln.compile(Widths().eval(), mode="balanced", cache_dir=str(tmp_path))  # a restart: the cache knows
    with torch.no_grad():
        again(x)
    assert [c.region for c in kiln.stats(again).compiles] == ["Mix#1", "Tokens#1"]
    assert set(kiln.stats(again).regions_eager) == {"Mix#2", "Mix#3"}


def test_after_a_first_region_measured_slower_its_class_compiles_nothing_more(timings, tmp_path):
    timings += [(1.1, 1.0), (0.5, 1.0)]  # Mix#1, then Tokens#1 (Mix#2 and Mix#3 are not compiled)
    torch.manual_seed(0)
    module, x = Widths().eval(), torch.randn(2, 4, 6, 6)
    compiled = kiln.compile(module, mode="balanced", cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-5
    info = kiln.stats(compiled)
    assert not timings and [c.region for c in info.compiles] == ["Mix#1", "Tokens#1"]
    assert info.regions_eager["Mix#2"] == info.regions_eager["Mix#3"] == (
        "not compiled: the first region of its class (Mix#1) measured slower compiled (compiled 1.100 ms, "
        "eager 1.000 ms a call (0.91x))")
