"""Kiln under ComfyUI's partial load (nodes/partial_load.py): a model that does not fit runs through ComfyUI's own
lowvram path with Kiln applied, its streamed blocks eager and its resident blocks compiled, with the same latents
as eager under the same partial load, and the node, the stats and the log say what happened.

ComfyUI never loads partly onto a CPU (load_models_gpu sets VRAMState.DISABLED there), so a small card is faked
in ComfyUI's own accounting (conftest.py's `small_card`). Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import logging
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import comfy.model_management as mm  # noqa: E402

from kiln.nodes import partial_load  # noqa: E402
from comfy_testing import compile_unet, kiln_stats, make_tiny_sd15_patcher, sample  # noqa: E402
from testing_utils import rel_err  # noqa: E402


def test_a_model_that_does_not_fit_runs_its_streamed_blocks_eagerly_with_eagers_latents(small_card, caplog):
    base = make_tiny_sd15_patcher()
    small_card["fraction"] = 0.5   # half the model fits
    eager = sample(base)
    assert base.model.model_lowvram, "ComfyUI did not load the model partly"
    assert any(partial_load.streamed(layer) for layer in base.model.diffusion_model.modules())
    model, _ = compile_unet(base, mode="fast")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        out = sample(model)
    assert rel_err(out, eager) < 1e-4
    stats = kiln_stats(model)
    verdict = stats.memory
    assert not verdict.fits and not verdict.cuda_graphs and verdict.eager_blocks, stats.summary()
    assert set(verdict.eager_blocks) < {path for region in stats.regions for path in region.members}
    assert stats.fallback is None and stats.compile_count >= 1   # the resident blocks compiled
    numbers = f"model {base.model_size() / 2**20:.1f} MiB, {base.model.model_loaded_weight_memory / 2**20:.1f} MiB resident, "
    assert verdict.why.startswith(numbers) and f"{len(verdict.eager_blocks)} of " in verdict.why
    assert "1.0 MiB free of a 4.0 MiB cap" in verdict.why
    assert f"memory: {verdict.why}" in stats.warnings and verdict.why in caplog.text
    # the blocks kept eager are exactly those holding a layer ComfyUI streams
    streamed = {path for path, block in model.get_model_object("diffusion_model").named_modules()
                if path in verdict.eager_blocks and any(partial_load.streamed(m) for m in block.modules())}
    assert streamed == set(verdict.eager_blocks)


def test_the_same_model_loaded_whole_again_compiles_every_block(small_card):
    base = make_tiny_sd15_patcher(seed=1)
    small_card["fraction"] = 0.5
    model, _ = compile_unet(base, mode="fast")
    sample(model)
    assert not kiln_stats(model).memory.fits
    mm.unload_all_models()
    small_card.pop("fraction")   # ComfyUI's own plan on a CPU: the whole model
    eager = sample(base)
    out = sample(model)
    assert not base.model.model_lowvram and rel_err(out, eager) < 1e-4
    assert kiln_stats(model).memory.fits and kiln_stats(model).memory.eager_blocks == ()


def test_the_node_says_when_comfyui_would_load_the_model_partly(small_card, monkeypatch, caplog):
    base = make_tiny_sd15_patcher(seed=2)
    # a CUDA card as ComfyUI's planner sees it: normal VRAM, a device that is not the CPU, the small card's free memory
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    monkeypatch.setattr(mm, "is_device_cpu", lambda device: False)
    monkeypatch.setattr(mm, "minimum_inference_memory", lambda: small_card["free"] // 4)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _, report = compile_unet(base, mode="fast")
    assert "Memory, as ComfyUI would load it now (its sampler's load decides): model " in report
    assert "the blocks it streams run eagerly" in report and "no whole-call CUDA graph" in report
    assert "Memory, as ComfyUI would load it now" in caplog.text


def test_the_node_says_nothing_of_memory_where_the_model_fits():
    _, report = compile_unet(make_tiny_sd15_patcher(seed=3), mode="fast")
    assert "Memory" not in report
