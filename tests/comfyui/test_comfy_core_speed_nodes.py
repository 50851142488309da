"""Core's own speed nodes in the same chain as Kiln › Compile UNet, on ComfyUI's SD1.5 classes (tiny, random weights):
- core's TorchCompileModel before or after Kiln: Kiln compiles the model, core's compiled module never runs, and
  Kiln says so (before: in the node's report; after: once in the log and on the node);
- core's EasyCache before or after Kiln: the image is EasyCache's eager image, EasyCache skips the same steps, and a
  second prompt compiles nothing (EasyCache's decisions run eagerly between Kiln's compiled blocks; a compile of
  the whole UNet would guard on EasyCache's state and recompile as it changes, as core's own compile does).
Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import logging
import os
import re

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import torch  # noqa: E402
from comfy_api.torch_helpers import set_torch_compile_wrapper  # noqa: E402

from kiln.nodes.plan_wrapper import CORE_REPLACED, CORE_SKIPPED  # noqa: E402
from comfy_testing import compile_unet, kiln_stats, make_tiny_sd15_patcher, sample  # noqa: E402
from testing_utils import psnr  # noqa: E402

easycache = pytest.importorskip("comfy_extras.nodes_easycache")

STEPS = 8  # enough steps for EasyCache to skip some (its default start is 15% of the way)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as ComfyUI runs every node
        yield


@pytest.fixture(scope="module")
def base():
    with torch.inference_mode():
        return make_tiny_sd15_patcher(seed=0)


def kiln(model):
    """Kiln › Compile UNet in mode fast (the default compile unit: blocks); (model, report)."""
    return compile_unet(model, mode="fast")



class CountingBackend:
    """A torch.compile backend for core's TorchCompileModel that counts the graphs it is given and runs them."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def core_compile(model, backend):
    """What core's TorchCompileModel node does to a MODEL."""
    patched = model.clone()
    set_torch_compile_wrapper(patched, backend=backend)
    return patched


def test_core_compile_before_kiln_is_replaced_and_the_report_says_so(base):
    backend = CountingBackend()
    model, report = kiln(core_compile(base, backend))
    assert CORE_REPLACED in report
    assert psnr(sample(model), sample(base)) >= 40
    assert backend.graphs == 0 and kiln_stats(model).compile_count > 0


def test_core_compile_after_kiln_is_skipped_and_said_once(base, caplog):
    backend = CountingBackend()
    kiln_model, _ = kiln(base)
    model = core_compile(kiln_model, backend)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        images = [sample(model, seed=seed) for seed in (3, 4)]
    assert backend.graphs == 0, "core's compiled module ran in place of Kiln's"
    assert kiln_stats(model).compile_count > 0
    assert [r.getMessage() for r in caplog.records].count(f"Kiln: {CORE_SKIPPED}") == 1
    assert psnr(images[1], sample(base, seed=4)) >= 40


def with_easycache(model):
    out = easycache.EasyCacheNode.execute(model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95,
                                          verbose=False)
    return out[0]


def skipped_steps(records) -> list[int]:
    """EasyCache's own count per sampling, from its log line."""
    return [int(m.group(1)) for r in records if (m := re.search(r"EasyCache - skipped (\d+)/", r.getMessage()))]


@pytest.mark.parametrize("order", ["easycache, then Kiln", "Kiln, then easycache"])
def test_easycache_with_kiln_gives_its_eager_image_and_never_recompiles(base, order, caplog):
    def chain(model):
        return kiln(with_easycache(model))[0] if order.startswith("easycache") else with_easycache(kiln(model)[0])

    model = chain(base)
    with caplog.at_level(logging.INFO):
        want = [sample(with_easycache(base), seed=seed, steps=STEPS) for seed in (3, 4)]
        eager_skips = skipped_steps(caplog.records)
        caplog.clear()
        got = [sample(model, seed=3, steps=STEPS)]
        compiles = kiln_stats(model).compile_count
        got.append(sample(model, seed=4, steps=STEPS))
        kiln_skips = skipped_steps(caplog.records)
    assert eager_skips and min(eager_skips) > 0, "EasyCache skipped nothing: the case tests nothing"
    assert kiln_skips == eager_skips
    assert min(psnr(g, w) for g, w in zip(got, want)) >= 40
    stats = kiln_stats(model)
    assert compiles > 0 and stats.compile_count == compiles, stats.summary()
    assert stats.fallback is None and stats.eager_calls == 0, stats.summary()
