"""Kiln's node on ComfyUI's own classes: a ModelPatcher around ComfyUI's UNetModel, sampled by
ComfyUI's KSampler path. Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args


from kiln.compiler import KilnPlan, build_options, model_for  # noqa: E402
from kiln.compiler.backend import lowering as lowering_module
from kiln.compiler.torch_compat import versions
from kiln.nodes.compile_unet import KilnCompileUNet  # noqa: E402
from kiln.nodes.plan_wrapper import PLAN_KEY  # noqa: E402
from comfy_testing import compile_unet, lora_like_patches, make_tiny_sd15_patcher, sample  # noqa: E402
from testing_utils import rel_err  # noqa: E402


@pytest.fixture(scope="module")
def compiled():
    base = make_tiny_sd15_patcher()
    model, report = compile_unet(base, mode="fast")
    return base, model, report


def test_node_reports_and_returns_a_clone(compiled):
    base, model, report = compiled
    assert model is not base and "Kiln will run UNetModel's plan on its first sampling step: compile (fast" in report
    node_default = build_options("fast", cuda_graphs=False, measure_regions=False).compile  # Compile UNet's graphs: off
    assert model.model_options[PLAN_KEY] == KilnPlan(compile=node_default)
    assert PLAN_KEY not in base.model_options  # the node never changes the MODEL it was given


def test_compiled_sampling_matches_eager_and_compiles_once(compiled):
    base, model, _ = compiled
    eager = sample(base)
    out = sample(model)
    assert rel_err(out, eager) < 1e-4
    info = _stats(model)
    assert info.compile_count >= 1 and not info.recompiles and info.fallback is None
    assert info.regions and info.compile_count == len(info.regions)  # ComfyUI's UNet compiles by blocks
    sample(model, seed=9)  # a new seed and noise: same shapes, no recompile
    sample(model, steps=3)  # another step count: ComfyUI's sigma schedule changes length
    sample(model, steps=5)
    assert not _stats(model).recompiles, _stats(model).summary()


def test_lora_after_compile_is_applied_without_recompiling(compiled):
    base, model, _ = compiled
    patches = lora_like_patches(base)
    lora_eager, lora_compiled = base.clone(), model.clone()  # what LoraLoader does after the node
    lora_eager.add_patches(patches, 0.8)
    lora_compiled.add_patches(patches, 0.8)
    graphs = _stats(model).compile_count
    ref, out = sample(lora_eager), sample(lora_compiled)
    assert rel_err(ref, sample(base)) > 1e-3  # the LoRA changes the image
    assert rel_err(out, ref) < 1e-4
    lora_compiled2 = model.clone()  # a new strength: new weights, same compiled graphs
    lora_compiled2.add_patches(patches, 0.3)
    lora_eager2 = base.clone()
    lora_eager2.add_patches(patches, 0.3)
    assert rel_err(sample(lora_compiled2), sample(lora_eager2)) < 1e-4
    assert _stats(model).compile_count == graphs, _stats(model).summary()


def test_new_batches_and_resolutions_run_without_compiling(compiled):
    """Batch 1 -> 2 -> 3 (CFG: the UNet sees 2, 4, 6) and new resolutions, odd and non-square ones
    included (latent 15x15 is 120x120 px, not a multiple of 64): equal to eager, no new graph."""
    base, model, _ = compiled
    sample(model)
    graphs = _stats(model).compile_count
    for batch, size, width in [(2, 16, 16), (3, 16, 16), (1, 24, 16), (2, 15, 15), (1, 12, 20)]:
        out, ref = sample(model, batch=batch, size=size, width=width), sample(base, batch=batch, size=size, width=width)
        assert out.shape == (batch, 4, size, width)
        assert rel_err(out, ref) < 1e-4, (batch, size, width)
    info = _stats(model)
    assert info.compile_count == graphs and info.regions, info.summary()
    assert info.variants == []  # compiled by blocks: each block's graph serves every size (the shape manager is the whole graph's)


def test_node_rerun_reuses_the_compiled_module(compiled):
    base, model, _ = compiled
    again, _ = compile_unet(base, mode="fast")
    assert _kiln_model(again) is _kiln_model(model)


def test_lora_before_or_after_the_node_gives_the_same_plan_module_and_image(compiled):
    """LoRA then Compile, or Compile then LoRA: one plan, one KilnModel, the image LoRA gives eagerly."""
    base, model, _ = compiled
    patches = lora_like_patches(base, seed=11)
    lora_first = base.clone()
    lora_first.add_patches(patches, 0.5)
    lora_then_compile, _ = compile_unet(lora_first, mode="fast")
    compile_then_lora = model.clone()
    compile_then_lora.add_patches(patches, 0.5)
    assert lora_then_compile.model_options[PLAN_KEY] == compile_then_lora.model_options[PLAN_KEY]
    assert _kiln_model(lora_then_compile) is _kiln_model(compile_then_lora)
    graphs = _stats(model).compile_count
    ref = sample(lora_first)
    assert rel_err(sample(lora_then_compile), ref) < 1e-4 and rel_err(sample(compile_then_lora), ref) < 1e-4
    assert _stats(model).compile_count == graphs


def test_a_cancel_during_the_compile_stops_the_prompt_and_the_next_one_compiles(monkeypatch):
    """ComfyUI's cancel: its progress-bar hook raises InterruptProcessingException (main.py's hook
    calls throw_exception_if_processing_interrupted). The prompt stops with that exception; nothing is
    marked failed; the next prompt compiles and matches eager."""
    import comfy.model_management
    import comfy.utils

    base = make_tiny_sd15_patcher(seed=2)
    model, _ = compile_unet(base, mode="fast")

    def cancelled(value, total, preview, node_id=None):
        raise comfy.model_management.InterruptProcessingException()

    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", cancelled)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        sample(model)
    info = _stats(model)
    assert info.fallback is None and info.compile_count == 0
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", None)
    assert rel_err(sample(model), sample(base)) < 1e-4
    assert info.fallback is None and info.compile_count == len(info.regions) > 0


def test_an_old_torch_runs_the_prompt_eagerly_with_the_reason_in_the_report(monkeypatch):
    monkeypatch.setattr(versions, "torch_version", lambda: (2, 3))
    base = make_tiny_sd15_patcher(seed=4)
    model, report = compile_unet(base, mode="fast")
    assert model is base and "older than 2.5" in report
    assert rel_err(sample(model), sample(base)) == 0


def test_a_failed_compile_runs_eagerly_and_says_so(monkeypatch, caplog):
    def broken_lowering(*args, **kwargs):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(lowering_module, "lower_graph", broken_lowering)
    base = make_tiny_sd15_patcher(seed=1)
    model, _ = compile_unet(base, mode="fast")
    assert rel_err(sample(model), sample(base)) < 1e-6  # the prompt still completes, eagerly
    assert "lowering exploded" in _stats(model).fallback
    assert "runs eagerly from now on" in caplog.text
    again, report = compile_unet(base, mode="fast")
    assert again is base and "lowering exploded" in report


def test_compile_unit_whole_in_the_advanced_options_compiles_one_graph():
    base = make_tiny_sd15_patcher(seed=6)
    model, _ = compile_unet(base, mode="fast", advanced="compile_unit: whole")
    assert rel_err(sample(model), sample(base)) < 1e-4
    info = _stats(model)
    assert not info.regions and info.compile_count == 1 and not info.recompiles, info.summary()


def test_background_in_the_advanced_options_samples_eagerly_until_the_regions_are_lowered():
    """`background: true`: the first prompt runs while the regions lower in a thread of Kiln's, each
    prompt gives eager's image, and once every region is lowered they run compiled, with no recompile."""
    import kiln

    base = make_tiny_sd15_patcher(seed=7)
    model, _ = compile_unet(base, mode="fast", advanced="background: true")
    eager = sample(base)
    assert rel_err(sample(model), eager) < 1e-4
    kiln_model = _kiln_model(model)
    for _ in range(len(kiln_model.stats.regions) + 2):  # a prompt hands in the regions its first calls reach
        if not kiln.wait_lowered(kiln_model, timeout=120):
            break
        assert rel_err(sample(model), eager) < 1e-4
    info = kiln_model.stats
    assert kiln.wait_lowered(kiln_model, timeout=0) == [], info.summary()
    assert info.compile_count >= 1 and not info.recompiles and info.fallback is None and not info.region_fallbacks
    graphs = info.compile_count
    assert rel_err(sample(model, size=24), sample(base, size=24)) < 1e-4  # a new size compiles nothing
    assert info.compile_count == graphs, info.summary()


@pytest.mark.slow
def test_by_default_a_region_stays_compiled_only_where_it_measures_faster():
    """Compile UNet as a user adds it: each region is compiled and kept, or runs eagerly with a kind the
    node's line counts (measured no faster, nothing to fuse, or not compiled after its class's first);
    the image is eager's and a new size compiles nothing."""
    base = make_tiny_sd15_patcher(seed=6)
    model, _ = KilnCompileUNet().compile(base, mode="balanced")
    assert rel_err(sample(model), sample(base)) < 1e-4
    info = _stats(model)
    assert info.regions and info.fallback is None and not info.region_fallbacks, info.summary()
    lowered = {c.region for c in info.compiles if c.lowering != "eager"}
    for region in info.regions:
        kind = info.eager_kinds.get(region.name)
        assert (region.name in lowered) == (kind in (None, "measured")), info.summary()
    assert set(info.region_timings) == lowered, info.summary()  # every region lowered was measured
    graphs = info.compile_count
    assert rel_err(sample(model, size=24), sample(base, size=24)) < 1e-4
    assert info.compile_count == graphs, info.summary()


def test_invalid_advanced_options_fail_with_the_key():
    from kiln.compiler import OptionsError

    with pytest.raises(OptionsError, match="unknown pass 'fuse_all'"):
        KilnCompileUNet().compile(make_tiny_sd15_patcher(), advanced="passes: {fuse_all: on}")


def _kiln_model(model):
    """The KilnModel the wrapper will run: the plan's handle on the shared diffusion model."""
    wrapper = model.get_wrappers("apply_model", "kiln.compile")[0]
    assert wrapper.plan == model.model_options[PLAN_KEY]
    return model_for(model.get_model_object("diffusion_model"), wrapper.plan)


def _stats(model):
    return _kiln_model(model).stats
