"""Kiln › Cache Graph on ComfyUI's own classes: Compile + Cache stores the UNet's graph; another model
object of the same architecture (a restart, another fine-tune, a LoRA) loads it instead of compiling
and samples like eager. Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")

from kiln.compiler import model_for  # noqa: E402
from kiln.nodes.cache_graph import KilnCacheGraph  # noqa: E402
from kiln.nodes.compile_unet import KilnCompileUNet  # noqa: E402
from kiln.nodes import plan_wrapper  # noqa: E402
from kiln.nodes.plan_wrapper import PLAN_KEY  # noqa: E402
from comfy_testing import lora_like_patches, make_tiny_sd15_patcher, sample  # noqa: E402
from testing_utils import rel_err  # noqa: E402

pytestmark = pytest.mark.slow


# every region lowered, whatever it measures: which regions stay compiled on a CPU turns on timings a few
# percent apart, and these tests are about what the cache stores and loads (tests/regional: the choice)
ADVANCED = "measure_regions: false"


def kiln_nodes(base, cache_dir, cache_first=True):
    if cache_first:
        cached, report = KilnCacheGraph().cache(base, "use", str(cache_dir), unique_id="13")
        return KilnCompileUNet().compile(cached, mode="balanced", advanced=ADVANCED)[0], report
    compiled = KilnCompileUNet().compile(base, mode="balanced", advanced=ADVANCED)[0]
    return KilnCacheGraph().cache(compiled, "use", str(cache_dir), unique_id="13")


def stats(patcher):
    plan = patcher.model_options[PLAN_KEY]
    return model_for(patcher.get_model_object("diffusion_model"), plan).stats


@pytest.fixture(scope="module", autouse=True)
def user_directory(tmp_path_factory):
    """ComfyUI's user directory, where a workflow's cache directory must lie: the test's own."""
    import folder_paths

    before = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path_factory.mktemp("user")))
    yield folder_paths.get_user_directory()
    folder_paths.set_user_directory(before)


@pytest.fixture(scope="module")
def cold(user_directory):
    cache_dir = os.path.join(user_directory, "cache")
    base = make_tiny_sd15_patcher(seed=0)
    model, report = kiln_nodes(base, cache_dir)
    return cache_dir, base, model, report, sample(model)


def test_the_node_reports_the_directory_and_what_comes_next(cold):
    cache_dir, _, _, report, _ = cold
    assert f"at {cache_dir}: 0 entries" in report and "0 for UNetModel" in report
    assert "once Kiln › Compile UNet is in the chain" in report


def test_cache_and_compile_in_either_order_make_one_plan(cold, tmp_path):
    cache_dir, base, model, _, _ = cold
    other, report = kiln_nodes(base, cache_dir, cache_first=False)
    assert other.model_options[PLAN_KEY] == model.model_options[PLAN_KEY]
    assert "decided per graph on the first sampling step" in report


def test_a_cold_compile_stores_the_unets_graph(cold):
    cache_dir, base, model, _, out = cold
    events = stats(model).cache
    assert events and events[0].outcome == "miss" and events[0].entry_bytes > 0
    assert rel_err(out, sample(base)) < 1e-4
    # compiled by blocks: one entry per region lowered (not those with nothing to fuse)
    lowered = sum(c.lowering != "eager" for c in stats(model).compiles)
    assert [e.outcome for e in events] == ["miss"] * lowered, stats(model).summary()
    assert f"{lowered} for UNetModel" in KilnCacheGraph().cache(base, "use", str(cache_dir))[1]


def test_another_model_of_the_architecture_loads_it_and_samples_like_eager(cold, monkeypatch):
    cache_dir, _, _, _, _ = cold
    shown = []
    monkeypatch.setattr(plan_wrapper, "show_text", lambda node, text: shown.append((node, text)))
    other = make_tiny_sd15_patcher(seed=4)  # a new UNet object, other weights: as after a restart or another fine-tune
    model, _ = kiln_nodes(other, cache_dir)
    out = sample(model)
    events = stats(model).cache
    # compiled by blocks: a hit per region lowered
    regions = [c.region for c in stats(model).compiles if c.lowering != "eager"]
    assert regions and [e.outcome for e in events] == ["hit"] * len(regions), stats(model).summary()
    # the Cache Graph node (id 13) shows them in ComfyUI's UI, in one message, though Compile UNet was declared after it
    assert len(shown) == 1 and shown[0][0] == "13" and shown[0][1].count("cache hit for UNetModel") == len(regions)
    assert rel_err(out, sample(other)) < 1e-4
    lora_model, lora_eager = model.clone(), other.clone()  # a LoRA after the Kiln nodes: same graph, live weights
    patches = lora_like_patches(other)
    lora_model.add_patches(patches, 0.8)
    lora_eager.add_patches(patches, 0.8)
    assert rel_err(sample(lora_model), sample(lora_eager)) < 1e-4
    assert [e.outcome for e in stats(model).cache] == ["hit"] * len(regions)  # no new graph for the LoRA


def test_a_workflow_naming_a_directory_outside_comfyuis_user_directory_compiles_without_the_cache(
        tmp_path, monkeypatch, caplog):
    """A stranger's workflow with cache_dir: ~ (or any folder of the user's): nothing is written or
    deleted there; the node says why, at once and at the first step, and the model still compiles."""
    import logging

    outside = tmp_path / "home"
    (outside / "work" / "2024-taxes").mkdir(parents=True)
    shown = []
    monkeypatch.setattr(plan_wrapper, "show_text", lambda node, text: shown.append((node, text)))
    base = make_tiny_sd15_patcher(seed=1)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cached, report = KilnCacheGraph().cache(base, "use", str(outside), unique_id="13")
        model = KilnCompileUNet().compile(cached, mode="balanced")[0]
        out = sample(model)
    assert "cannot be used" in report and "outside the directories a workflow may use" in report
    assert "KILN_CACHE_DIR" in report and shown[0] == ("13", report)
    events = stats(model).cache
    assert stats(model).compile_count >= 1 and not stats(model).fallback
    assert {e.outcome for e in events} == {"unavailable"} and "outside the directories" in events[0].reason
    assert "outside the directories a workflow may use" in caplog.text
    assert sorted(os.listdir(outside)) == ["work"] and os.listdir(outside / "work") == ["2024-taxes"]
    assert rel_err(out, sample(base)) < 1e-4
    relative, report = KilnCacheGraph().cache(base, "use", "my-cache")  # a folder in the user directory
    assert os.path.join(folder_paths_user(), "my-cache") in report and "cannot be used" not in report


def folder_paths_user() -> str:
    import folder_paths

    return folder_paths.get_user_directory()
