"""The glue between blocks as regions of its own (compiler/regional/glue.py). The CUDA case is played on a
CPU with the device the glue and the region choice read set to "cuda" and the timings injected, as in
tests/regional/test_gpu_choice.py."""
import logging

import pytest
import torch

import kiln
from kiln.compiler import CompileOptions, OptionsError
from kiln.compiler.regional import glue, regional_compile
from kiln.compiler.regional.blocks import regions_of
from kiln.testing.models import MODELS
from testing_utils import Block, answer_region_timings, rel_err


class Embed(torch.nn.Module):
    """A time embedding: sinusoids and a small MLP (the model's own code: glue)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, t):
        half = self.lin.in_features // 2
        angles = t[:, None] * torch.exp(-torch.arange(half, dtype=t.dtype) / half)
        return torch.nn.functional.silu(self.lin(torch.cat([angles.sin(), angles.cos()], dim=-1))) * 0.5


class Out(torch.nn.Module):
    """A final norm, activation and projection (glue)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.proj = torch.nn.LayerNorm(width), torch.nn.Linear(width, 4)

    def forward(self, x):
        return self.proj(torch.nn.functional.silu(self.norm(x)) + 1.0)


class GlueNet(torch.nn.Module):
    """Three identical blocks between an embedding (unless `embed` is false), a lone input layer and a final layer."""

    def __init__(self, width: int = 16, embed: bool = True):
        super().__init__()
        self.embed = Embed(width) if embed else None
        self.proj_in, self.out = torch.nn.Linear(4, width), Out(width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(3))

    def forward(self, x, t):
        h = self.proj_in(x)
        if self.embed is not None:
            h = h + self.embed(t)[:, None, :]
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _net(embed: bool = True) -> GlueNet:
    torch.manual_seed(0)
    return GlueNet(embed=embed).eval()


def _inputs():
    torch.manual_seed(1)
    return torch.randn(2, 5, 4), torch.rand(2) * 1000


def _on_cuda(monkeypatch, answers):
    """The glue and the region choice see "cuda"; each region's timing is the next of `answers` (both
    sides still run once, as a timing would). The devices the timings were asked for are returned."""
    monkeypatch.setattr(glue, "model_device", lambda module: "cuda")
    monkeypatch.setattr(regional_compile, "device_type_of", lambda values: "cuda")
    return answer_region_timings(monkeypatch, answers)


def _run(module, cache_dir=None, **options):
    compiled = kiln.compile(module, options=CompileOptions(mode="fast", **options), cache_dir=cache_dir)
    x, t = _inputs()
    with torch.no_grad():
        out, eager = compiled(x, t), module(x, t)
    return compiled, out, eager


def test_the_glue_modules_of_sd15_sdxl_and_flux():
    """What runs outside regions: lone layers (conv_in, conv_out, x_embedder) and the forwards stay eager."""
    expected = {
        "sd15": ["time_proj", "time_embedding"],
        "sdxl": ["time_proj", "time_embedding", "add_time_proj", "add_embedding"],
        "flux": ["pos_embed", "time_text_embed", "norm_out"],
    }
    for name, paths in expected.items():
        model = MODELS[name].build("tiny")
        blocks = [block for _, members in regions_of(model) for block in members]
        assert [path for path, _ in glue.find_glue(model, blocks)] == paths, name


def test_glue_in_a_container_is_found_and_a_module_holding_blocks_is_looked_into():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(8) for _ in range(2))
            self.norm = torch.nn.LayerNorm(8)  # a lone layer: stays eager

    model = torch.nn.Module()
    model.stages = torch.nn.ModuleList([Holder()])
    model.time_embed = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.Linear(8, 8))
    model.extra = torch.nn.ModuleDict({"mlp": Embed(8)})
    blocks = [block for _, members in regions_of(model) for block in members]
    assert [path for path, _ in glue.find_glue(model, blocks)] == ["time_embed", "extra.mlp"]


def test_on_a_cpu_the_glue_is_not_looked_for_by_default(monkeypatch):
    monkeypatch.setattr(glue, "find_glue", lambda *a: pytest.fail("the glue was looked for on a CPU"))
    module = _net()
    compiled, out, eager = _run(module, measure_regions=False)
    info = kiln.stats(compiled)
    assert rel_err(out, eager) < 1e-5
    assert [region.name for region in info.regions] == ["Block#1"] and "glue" not in info.units_line()


def test_on_cuda_glue_is_compiled_where_it_saves_gpu_time_and_eager_with_the_reason_where_not(monkeypatch, caplog):
    answers = [(0.5, 1.0), (0.4, 1.0), (1.1, 1.0)]  # glue.Embed#1 pays, Block#1 pays, glue.Out#1 does not
    devices = _on_cuda(monkeypatch, answers)
    caplog.set_level(logging.INFO, logger="kiln")
    module = _net()
    compiled, out, eager = _run(module)
    info = kiln.stats(compiled)
    assert not answers and devices == ["cuda"] * 3 and rel_err(out, eager) < 1e-5
    assert [region.name for region in info.regions] == ["Block#1", "glue.Embed#1", "glue.Out#1"]
    assert list(info.region_timings) == ["glue.Embed#1", "Block#1", "glue.Out#1"]
    assert list(info.regions_eager) == ["glue.Out#1"]
    assert info.regions_eager["glue.Out#1"].startswith("measured no faster compiled")
    assert "region glue.Out#1 runs eagerly: measured no faster compiled" in caplog.text
    assert "region glue.Embed#1 stays compiled" in caplog.text
    assert "3 blocks in 1 regions and the glue in 2 region(s)" in info.units_line()
    graphs = info.compile_count
    x, t = _inputs()
    with torch.no_grad():
        assert rel_err(compiled(x * 2, t), module(x * 2, t)) < 1e-5
    assert info.compile_count == graphs and not info.recompiles and not info.region_fallbacks


def test_on_cuda_glue_that_cannot_be_measured_runs_eagerly_unless_asked_for(monkeypatch):
    answers = [(0.4, 1.0), (0.5, 1.0)] * 2  # glue.Embed#1 and Block#1, in each of the two compiles
    _on_cuda(monkeypatch, answers)
    module = _net()
    module.out.register_forward_hook(lambda m, args, out: None)  # a hook may keep state: not timed again
    compiled, out, eager = _run(module)
    info = kiln.stats(compiled)
    assert rel_err(out, eager) < 1e-5 and list(info.regions_eager) == ["glue.Out#1"]
    assert info.regions_eager["glue.Out#1"].startswith("not measured against eager (the block has forward hooks)")
    assert info.eager_kinds["glue.Out#1"] == "unmeasured_glue"
    compiled, out, eager = _run(module, glue_regions="on")  # asked for: it stays compiled, as a block would
    assert rel_err(out, eager) < 1e-5 and not kiln.stats(compiled).regions_eager and not answers


def test_glue_regions_option(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kiln")
    compiled, out, eager = _run(_net(), glue_regions="on", measure_regions=False)  # asked for on a CPU
    assert rel_err(out, eager) < 1e-5
    assert [c.region for c in kiln.stats(compiled).compiles] == ["glue.Embed#1", "Block#1", "glue.Out#1"]
    answers = [(0.5, 1.0)]  # Block#1, measured with glue_regions off
    _on_cuda(monkeypatch, answers)
    for options in ({"glue_regions": "off"}, {"measure_regions": False}):
        compiled, out, eager = _run(_net(), **options)
        assert rel_err(out, eager) < 1e-5 and [r.name for r in kiln.stats(compiled).regions] == ["Block#1"]
    assert not answers and "glue between its blocks runs eagerly: glue_regions: off" in caplog.text
    assert "compiles it only where each region's choice is measured" in caplog.text
    assert CompileOptions(glue_regions=True).glue_regions == "on"  # YAML's bare on
    with pytest.raises(OptionsError, match="glue_regions='always': use one of auto, on, off"):
        CompileOptions(glue_regions="always")


def test_a_glue_region_s_choice_is_kept_in_the_cache_and_read_by_another_model(monkeypatch, tmp_path, caplog):
    answers = [(0.5, 1.0), (0.4, 1.0), (1.1, 1.0)]
    _on_cuda(monkeypatch, answers)
    _run(_net(), cache_dir=str(tmp_path))
    assert not answers
    caplog.set_level(logging.INFO, logger="kiln")
    module = _net()  # another model object with the same modules: what a restarted server has
    compiled, out, eager = _run(module, cache_dir=str(tmp_path))  # nothing measured again (no answer left)
    info = kiln.stats(compiled)
    assert rel_err(out, eager) < 1e-5
    assert [c.region for c in info.compiles] == ["glue.Embed#1", "Block#1"]  # glue.Out#1 not captured
    assert info.regions_eager["glue.Out#1"].endswith("(measured before, from Kiln's cache)")
    assert "region glue.Embed#1 stays compiled" in caplog.text and "from Kiln's cache" in caplog.text


def test_the_cache_stores_an_entry_per_glue_region_and_another_model_loads_them(tmp_path):
    options = CompileOptions(mode="balanced", glue_regions="on", measure_regions=False)
    x, t = _inputs()
    first = kiln.compile(_net(embed=False), options=options, cache_dir=str(tmp_path))  # two lowerings: Block#1, glue
    with torch.no_grad():
        first(x, t)
    assert [e.outcome for e in kiln.stats(first).cache] == ["miss", "miss"]
    module = _net(embed=False)  # another model object with the same modules: what a restarted server has
    second = kiln.compile(module, options=options, cache_dir=str(tmp_path))
    with torch.no_grad():
        assert rel_err(second(x, t), module(x, t)) < 1e-5
    info = kiln.stats(second)
    assert [e.outcome for e in info.cache] == ["hit", "hit"]
    assert [c.region for c in info.compiles] == ["Block#1", "glue.Out#1"]
