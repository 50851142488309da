"""Kiln › Step Cache on ComfyUI's SD1.5 classes (tiny, random weights: the skip decisions mean nothing for
quality here, `kiln bench --step-cache` measures that on a trained model; what is checked is how the node
rides on ComfyUI's sampling): threshold 0 gives the uncached image bit for bit, skips follow the settings
and are reported after each run, a new prompt at another size and step count starts fresh, CFG's cond and
uncond share the decision, denoise < 1 works, a bad setting is refused by name, and with Kiln › Compile
UNet the compiled graphs are the same and new settings never recompile; each method (reuse, first_block).
Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import logging
import os
import re

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import comfy.sample  # noqa: E402
import nodes  # noqa: E402
import torch  # noqa: E402

from kiln.choices import STEP_CACHE_METHODS  # noqa: E402
from kiln.compiler import StepCacheError  # noqa: E402
from kiln.nodes.step_cache import KilnStepCache  # noqa: E402
from comfy_testing import compile_unet, kiln_stats, lora_like_patches, make_tiny_controlnet, make_tiny_sd15_patcher, sample  # noqa: E402

STEPS = 10


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as ComfyUI runs every node
        yield


@pytest.fixture(scope="module")
def base():
    with torch.inference_mode():
        return make_tiny_sd15_patcher(seed=0)


def step_cache(model, **settings):
    return KilnStepCache().apply(model, **settings)


def patterns(records) -> list[str]:
    """Each run's pattern (one key: ComfyUI batches cond and uncond into one call)."""
    found = []
    for r in records:
        m = re.search(r"Kiln: step cache: .*; [^:]+: ([Cs]+)$", r.getMessage())
        if m:
            found.append(m.group(1))
    return found


@pytest.mark.parametrize("method", STEP_CACHE_METHODS)
def test_threshold_zero_gives_the_uncached_image_bit_for_bit(base, caplog, method):
    model, report = step_cache(base, method=method, threshold=0.0)
    assert "threshold 0" in report
    with caplog.at_level(logging.INFO, logger="kiln"):
        got = sample(model, steps=STEPS)
    assert torch.equal(got, sample(base, steps=STEPS))
    assert patterns(caplog.records) == ["C" * STEPS]


@pytest.mark.parametrize("method", STEP_CACHE_METHODS)
def test_skips_follow_the_settings_and_each_run_starts_fresh(base, caplog, method):
    model, _ = step_cache(base, method=method, threshold=10.0, start_percent=0.2, end_percent=0.8,
                          max_consecutive_skips=2)
    with caplog.at_level(logging.INFO, logger="kiln"):
        first = sample(model, steps=STEPS)
        second = sample(model, steps=6, size=24, width=16, seed=4)   # another size and step count
    runs = patterns(caplog.records)
    assert [len(p) for p in runs] == [STEPS, 6], runs
    assert "s" in runs[0] and "sss" not in runs[0] and runs[0][:2] == "CC" and runs[0][-2:] == "CC", runs
    assert first.shape == (1, 4, 16, 16) and second.shape == (1, 4, 24, 16)
    assert torch.isfinite(first).all() and torch.isfinite(second).all()


def test_the_last_step_computes_even_with_no_end_percent(base, caplog):
    model, _ = step_cache(base, threshold=10.0, start_percent=0.0, end_percent=1.0, max_consecutive_skips=100)
    with caplog.at_level(logging.INFO, logger="kiln"):
        sample(model, steps=STEPS)
    (run,) = patterns(caplog.records)
    assert run[0] == "C" and run[-1] == "C" and "s" in run, run


def test_denoise_below_one_runs_through_the_cache(base, caplog):
    model, _ = step_cache(base, threshold=10.0, start_percent=0.0)
    torch.manual_seed(0)
    latent, noise = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16)
    context = base.model.model_config.unet_config["context_dim"]
    pos, neg = [[torch.randn(1, 7, context), {}]], [[torch.randn(1, 7, context), {}]]
    with caplog.at_level(logging.INFO, logger="kiln"):
        out = comfy.sample.sample(model, noise, STEPS, 7.0, "euler", "normal", pos, neg, latent, denoise=0.6,
                                  disable_pbar=True, seed=1)
    (run,) = patterns(caplog.records)
    assert torch.isfinite(out).all() and "s" in run


@pytest.mark.parametrize("setting, value, words", [("threshold", -0.5, "step_cache.threshold=-0.5"),
                                                   ("method", "magic", "step_cache.method='magic'"),
                                                   ("max_consecutive_skips", 1.5, "max_consecutive_skips=1.5")])
def test_a_bad_setting_is_refused_by_name(base, setting, value, words):
    with pytest.raises(StepCacheError, match=re.escape(words)):
        step_cache(base, **{setting: value})


@pytest.mark.parametrize("method", STEP_CACHE_METHODS)
@pytest.mark.parametrize("order", ["step cache, then Kiln", "Kiln, then step cache"])
def test_with_kiln_compile_the_image_is_the_eager_one_and_new_settings_never_recompile(base, order, method, caplog):
    def chain(model, threshold):
        if order.startswith("step"):
            return compile_unet(step_cache(model, method=method, threshold=threshold)[0], mode="fast")[0]
        return step_cache(compile_unet(model, mode="fast")[0], method=method, threshold=threshold)[0]

    with caplog.at_level(logging.INFO, logger="kiln"):
        want = sample(step_cache(base, method=method, threshold=10.0)[0], steps=STEPS)
        eager_runs = patterns(caplog.records)
        caplog.clear()
        model = chain(base, 10.0)
        got = sample(model, steps=STEPS)
        compiles = kiln_stats(model).compile_count
        again = chain(base, 0.3)  # a new threshold: the same compiled graphs
        sample(again, steps=STEPS - 2, seed=5)
        kiln_runs = patterns(caplog.records)
    assert kiln_runs[0] == eager_runs[0] and "s" in kiln_runs[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    stats = kiln_stats(again)
    assert compiles > 0 and stats.compile_count == compiles and not stats.recompiles, stats.summary()


def with_lora(model):
    patched = model.clone()
    patched.add_patches(lora_like_patches(patched, scale=1.0), 1.0)
    return patched


def test_a_lora_after_the_node_changes_the_image_as_one_before_it(base, caplog):
    """Wherever the LoRA sits, the step cache sees the patched model: the same image, the same skips."""
    settings = dict(threshold=10.0, start_percent=0.2)
    with caplog.at_level(logging.INFO, logger="kiln"):
        after = sample(with_lora(step_cache(base, **settings)[0]), steps=STEPS)
        before = sample(step_cache(with_lora(base), **settings)[0], steps=STEPS)
        plain = sample(step_cache(base, **settings)[0], steps=STEPS)
    runs = patterns(caplog.records)
    assert runs[0] == runs[1] and "s" in runs[0]
    assert torch.equal(after, before)
    # (random weights: the attention projections move this tiny model's image by about 1% of its range)
    assert (after - plain).abs().max() > 0.01 * plain.abs().max(), "the LoRA changed nothing: the case tests nothing"


def test_a_controlnets_effect_survives_the_skipped_steps(base, caplog):
    """A ControlNet's residuals enter the model through the conds: a skipped step reuses a change made with
    them, and the image stays the controlled one, not the uncontrolled."""
    control_net, hint = make_tiny_controlnet(), torch.rand(1, 128, 128, 3)
    context = base.model.model_config.unet_config["context_dim"]

    def run(model, strength):
        torch.manual_seed(3)
        pos, neg = [[torch.randn(1, 7, context), {}]], [[torch.randn(1, 7, context), {}]]
        pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, control_net, hint, strength, 0.0, 1.0)
        noise = torch.randn(1, 4, 16, 16)
        return comfy.sample.sample(model, noise, STEPS, 7.0, "euler", "normal", pos, neg, torch.zeros(1, 4, 16, 16),
                                   disable_pbar=True, seed=3)

    cached, _ = step_cache(base, threshold=10.0, start_percent=0.2)
    with caplog.at_level(logging.INFO, logger="kiln"):
        controlled, uncontrolled = run(cached, 1.0), run(cached, 0.0)
    assert all("s" in p for p in patterns(caplog.records))
    exact_controlled, exact_uncontrolled = run(base, 1.0), run(base, 0.0)
    effect = (exact_controlled - exact_uncontrolled).abs().mean()
    assert effect > 0, "the ControlNet changed nothing: the case tests nothing"
    # the cached image keeps the ControlNet's effect: nearer the controlled image than the uncontrolled one
    assert (controlled - exact_controlled).abs().mean() < (controlled - exact_uncontrolled).abs().mean()
    assert (controlled - uncontrolled).abs().mean() > 0.5 * effect


@pytest.mark.parametrize("method", STEP_CACHE_METHODS)
def test_a_flow_model_runs_through_the_cache_too(caplog, method):
    """Flux's sampling (CONST: the input as is, sigmas in [0, 1], guidance-distilled: one cond, no CFG),
    ComfyUI's own Flux classes scaled down: threshold 0 is the uncached image, skips keep it finite."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    tiny = dict(image_model="flux", in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=32,
                mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
                patch_size=2, qkv_bias=True, guidance_embed=False, txt_ids_dims=[])
    torch.manual_seed(0)
    model = comfy.model_base.Flux(comfy.supported_models.Flux(tiny), device=torch.device("cpu"))
    for p in model.parameters():  # random weights at a sane scale
        p.data.normal_(0, 0.05)
    flux = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    noise, latent = torch.randn(1, 4, 16, 16), torch.zeros(1, 4, 16, 16)
    pos = [[torch.randn(1, 7, 32), {"pooled_output": torch.randn(1, 16)}]]

    def run(m):
        return comfy.sample.sample(m, noise, STEPS, 1.0, "euler", "simple", pos, pos, latent, disable_pbar=True, seed=1)

    reference = run(flux)
    with caplog.at_level(logging.INFO, logger="kiln"):
        exact = run(step_cache(flux, method=method, threshold=0.0)[0])
        cached = run(step_cache(flux, method=method, threshold=10.0, start_percent=0.2)[0])
    assert torch.equal(exact, reference)
    runs = patterns(caplog.records)
    assert runs[0] == "C" * STEPS and "s" in runs[1] and len(runs[1]) == STEPS, runs
    assert torch.isfinite(cached).all()


def test_it_composes_with_quantize_model_and_cache_graph(base, caplog, tmp_path):
    """Quantize Model -> Cache Graph -> Compile UNet -> Step Cache: the plan's model, skipping as eagerly quantized."""
    from kiln.nodes.cache_graph import KilnCacheGraph
    from kiln.nodes.quantize_model import KilnQuantizeModel

    quantized = KilnQuantizeModel().quantize(base, "int8_weight", policy="min_params: 0")[0]
    cached_graphs = KilnCacheGraph().cache(quantized, cache="off")[0]
    chain = step_cache(compile_unet(cached_graphs, mode="fast")[0], threshold=10.0)[0]
    with caplog.at_level(logging.INFO, logger="kiln"):
        want = sample(step_cache(quantized, threshold=10.0)[0], steps=STEPS)
        got = sample(chain, steps=STEPS)
    runs = patterns(caplog.records)
    assert runs[0] == runs[1] and "s" in runs[1], runs
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert kiln_stats(chain).compile_count > 0
