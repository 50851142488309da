"""Kiln's example workflows against a real ComfyUI server started here (CPU), with Kiln installed as a
custom node pack and the model files the workflows name made from random-weight stand-ins:

- every API workflow passes the server's own node definitions (/object_info: every class, core's
  and Kiln's, every required input, link types, model files), and every UI file converts to its API
  twin with those definitions (and, where Chromium and selenium are installed, in ComfyUI's own
  frontend, as a drag-and-drop does);
- every SD1.5 workflow runs (slow): tiny sizes, 2 steps, Kiln in mode fast, images saved, and the
  compiled UNet's image equals the one the same workflow gives without Kiln's compile nodes (Quantize
  Model and Step Cache stay in both); the file Save Quantized Model's workflow writes is the one Load
  Quantized Model's workflow reads.

Runs when COMFYUI_PATH points at a ComfyUI tree whose models folder holds an SD1.5 checkpoint
`checkpoints/rand_sd15_tiny.safetensors` and a LoRA for it `loras/rand_lora_tiny.safetensors` (random
weights are enough: every image is compared with the same workflow run without Kiln); skips otherwise."""
import json
import os
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
COMFY = Path(COMFYUI_PATH)
CHECKPOINT = COMFY / "models" / "checkpoints" / "rand_sd15_tiny.safetensors"
LORA = COMFY / "models" / "loras" / "rand_lora_tiny.safetensors"
if not CHECKPOINT.exists() or not LORA.exists():
    pytest.skip(f"no SD1.5 checkpoint {CHECKPOINT} and LoRA {LORA} (random weights are enough)",
                allow_module_level=True)

from kiln.client.comfy import ComfyClient  # noqa: E402
from kiln.client.workflow import KILN_COMPILE_NODES, check_prompt, ui_to_api, without_nodes  # noqa: E402
from kiln.testing.comfy_server import comfy_server  # noqa: E402
from kiln.testing.comfy_server import make_base_dir as make_linked_base_dir  # noqa: E402
from comfy_testing import save_tiny_controlnet  # noqa: E402

REPO = Path(__file__).parents[2]
FOLDER = REPO / "workflows"
API_FILES = sorted((FOLDER / "api").glob("*_api.json"))
PORT = 8191


def model_files(api_files) -> dict[str, set[str]]:
    """{models folder: file names} the workflows name."""
    folders = {"ckpt_name": "checkpoints", "unet_name": "diffusion_models", "lora_name": "loras",
               "control_net_name": "controlnet", "vae_name": "vae", "clip_name1": "text_encoders",
               "clip_name2": "text_encoders"}
    names: dict[str, set[str]] = {}
    for path in api_files:
        for node in json.loads(path.read_text()).values():
            for key, value in node["inputs"].items():
                if key in folders and isinstance(value, str):
                    names.setdefault(folders[key], set()).add(value)
    return names


def make_base_dir(base: Path) -> None:
    """A ComfyUI base directory: Kiln as a custom node pack, and each model file the workflows name,
    linked to a random-weight stand-in (the SD1.5 ones are real tiny models; SDXL and Flux names only
    need to exist for the definition check)."""
    controlnet = base / "tiny_controlnet.pth"
    save_tiny_controlnet(controlnet)
    stand_ins = {"checkpoints": CHECKPOINT, "loras": LORA, "controlnet": controlnet}
    models = {folder: {name: stand_ins.get(folder, CHECKPOINT) for name in names}
              for folder, names in model_files(API_FILES).items()}
    make_linked_base_dir(base, models)
    shutil.copy(COMFY / "input" / "example.png", base / "input" / "example.png")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-base")
    make_base_dir(base)
    with comfy_server(COMFY, base, PORT) as (url, object_info):
        yield url, object_info, base


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_an_api_workflow_passes_the_servers_node_definitions(server, path):
    _, object_info, _ = server
    assert check_prompt(json.loads(path.read_text()), object_info) == []


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_a_ui_file_converts_to_its_api_twin(server, path):
    _, object_info, _ = server
    ui = json.loads((FOLDER / path.name.replace("_api.json", ".json")).read_text())
    got, want = ui_to_api(ui, object_info), json.loads(path.read_text())
    assert {k: (v["class_type"], v["inputs"]) for k, v in got.items()} == \
        {k: (v["class_type"], v["inputs"]) for k, v in want.items()}


# Text the frontend shows the user about a loaded workflow: toasts, alerts and dialogs (missing nodes or models,
# schema errors, "created with a newer version").
MESSAGES_JS = """
const out = [];
for (const e of document.querySelectorAll('.p-toast-message, [role=alert], [role=alertdialog], [role=dialog]')) {
  const text = (e.innerText || '').trim();
  if (text) out.push(text.slice(0, 400));
}
return out;"""

LOAD_JS = """
const [workflow, done] = arguments;
(async () => {
  try {
    await app.loadGraphData(workflow);
    await new Promise(resolve => setTimeout(resolve, 500));  // the frontend's checks after a load
    const missing = workflow.nodes.map(n => n.type).filter(t => !LiteGraph.registered_node_types[t]);
    done({output: (await app.graphToPrompt()).output, missing});
  } catch (e) { done({error: String(e)}); }
})();"""

# What the Templates browser does with an entry: fetch the pack's file and load it as a UI workflow.
TEMPLATES_JS = """
const done = arguments[0];
(async () => {
  const packs = await (await fetch('/api/workflow_templates')).json();
  const opened = {};
  for (const [pack, names] of Object.entries(packs)) {
    for (const name of names) {
      const workflow = await (await fetch(`/api/workflow_templates/${pack}/${name}.json`)).json();
      await app.loadGraphData(workflow);
      opened[`${pack}/${name}`] = app.graph.nodes.length;
    }
  }
  done(opened);
})();"""


@pytest.fixture(scope="module")
def frontend(server):
    """ComfyUI's own frontend in headless Chromium, opened on the test server, ready to load workflows."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.skip("Chromium and chromedriver are not installed")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    url, _, _ = server
    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--window-size=1600,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_script_timeout(120)
    try:
        driver.get(url)
        deadline = time.monotonic() + 60
        while not driver.execute_script("return !!(window.app && window.app.graph)"):
            assert time.monotonic() < deadline, "ComfyUI's frontend did not load"
            time.sleep(0.5)
        time.sleep(3)  # the frontend registers node definitions after app.graph exists
        yield driver
    finally:
        driver.quit()


def test_comfyuis_own_frontend_loads_every_ui_file_as_its_api_twin(frontend):
    """What a drag-and-drop does: the frontend loads the UI file, says nothing about it (no missing node or
    model, no schema warning), and graphToPrompt() gives the prompt."""
    already_shown = set(frontend.execute_script(MESSAGES_JS))  # the frontend's own start-up messages, if any
    for path in API_FILES:
        ui = json.loads((FOLDER / path.name.replace("_api.json", ".json")).read_text())
        result = frontend.execute_async_script(LOAD_JS, ui)
        assert "error" not in result and result["missing"] == [], (path.name, result)
        shown = [text for text in frontend.execute_script(MESSAGES_JS) if text not in already_shown]
        assert shown == [], (path.name, shown)
        want = json.loads(path.read_text())
        assert {k: (v["class_type"], v["inputs"]) for k, v in result["output"].items()} == \
            {k: (v["class_type"], v["inputs"]) for k, v in want.items()}, path.name


def test_every_templates_browser_entry_opens_as_a_graph(frontend):
    """The Templates browser lists the pack's workflows/*.json and opens each as a UI workflow: every entry is
    one of the UI files and opens with its nodes (an API file there would open as an empty graph)."""
    opened = frontend.execute_async_script(TEMPLATES_JS)
    ui_files = {path.stem: len(json.loads(path.read_text())["nodes"]) for path in FOLDER.glob("*.json")}
    assert {entry.split("/", 1)[1]: nodes for entry, nodes in opened.items()
            if entry.startswith("comfyui-kiln/")} == ui_files


# ---- running the SD1.5 workflows ------------------------------------------------------------

SMALL = {"EmptyLatentImage": {"width": 192, "height": 192}, "ImageScale": {"width": 224, "height": 160}}
RUN = ["kiln_sd15_compile", "kiln_sd15_lora", "kiln_sd15_cache", "kiln_sd15_controlnet", "kiln_sd15_img2img",
       "kiln_sd15_all", "kiln_sd15_quantize", "kiln_sd15_step_cache"]
SAVE, LOAD = "kiln_sd15_save_quantized", "kiln_sd15_load_quantized"  # the second reads what the first writes
SAVED_AS = "kiln/saved_by_the_test"  # in the server's diffusion_models: a name no stand-in of make_base_dir takes


def small(api: dict) -> dict:
    """The workflow at a tiny size, 2 steps, Kiln in mode fast, Kiln's cache in the server's user folder."""
    out = json.loads(json.dumps(api))
    for node in out.values():
        inputs = node["inputs"]
        inputs.update(SMALL.get(node["class_type"], {}))
        if node["class_type"] == "KSampler":
            inputs["steps"] = 2
        if node["class_type"].startswith("KilnCompile"):
            inputs["mode"] = "fast"
        if node["class_type"] == "KilnCacheGraph":
            inputs["cache_dir"] = "kiln-test-cache"  # a folder in the server's user directory
        if node["class_type"] == "KilnQuantizeModel":
            inputs["scheme"] = "int8_weight"
    return out


def small_workflow(stem: str) -> dict:
    """The API twin of workflows/<stem>.json, made small."""
    return small(json.loads((FOLDER / "api" / f"{stem}_api.json").read_text()))


def run(client: ComfyClient, prompt: dict, url: str) -> bytes:
    record = client.wait(client.submit(prompt))
    images = [image for output in record["outputs"].values() for image in output.get("images", [])]
    assert len(images) == 1, record
    query = urllib.parse.urlencode({k: images[0][k] for k in ("filename", "subfolder", "type")})
    with urllib.request.urlopen(f"{url}/view?{query}", timeout=60) as response:
        return response.read()


def assert_the_image_it_gives_without_kiln(url: str, api: dict, stem: str) -> None:
    """`api` gives one image, which matches to 40 dB PSNR or better the one it gives without Kiln's compile nodes."""
    import io

    import numpy as np
    from PIL import Image

    client = ComfyClient(url, timeout=900)
    kiln_png, eager_png = run(client, api, url), run(client, without_nodes(api, KILN_COMPILE_NODES), url)
    kiln_image, eager_image = (np.asarray(Image.open(io.BytesIO(png)), dtype=np.float64) for png in (kiln_png, eager_png))
    mse = ((kiln_image - eager_image) ** 2).mean()
    assert mse == 0 or 10 * np.log10(255 ** 2 / mse) >= 40, f"{stem}: PSNR {10 * np.log10(255 ** 2 / mse):.1f} dB"


def with_inputs(api: dict, class_type: str, **inputs) -> dict:
    """`api` with `inputs` set on its one node of `class_type`."""
    (node,) = [node for node in api.values() if node["class_type"] == class_type]
    node["inputs"].update(inputs)
    return api


@pytest.mark.slow
@pytest.mark.parametrize("stem", RUN)
def test_an_sd15_workflow_runs_and_gives_the_image_it_gives_without_kiln(server, stem):
    url, _, _ = server
    assert_the_image_it_gives_without_kiln(url, small_workflow(stem), stem)


@pytest.mark.slow
def test_the_saved_quantized_model_loads_in_its_workflow_and_gives_the_image_it_gives_without_kiln(server):
    from kiln.nodes.quantize_model import saved_by_kiln

    url, _, base = server
    save = with_inputs(small_workflow(SAVE), "KilnSaveQuantizedModel", filename=SAVED_AS)
    client = ComfyClient(url, timeout=900)
    record = client.wait(client.submit(save))
    saved = base / "models" / "diffusion_models" / f"{SAVED_AS}.safetensors"
    assert saved_by_kiln(str(saved)), (saved, record["outputs"])
    load = with_inputs(small_workflow(LOAD), "KilnLoadQuantizedModel", unet_name=f"{SAVED_AS}.safetensors")
    assert_the_image_it_gives_without_kiln(url, load, LOAD)


@pytest.mark.slow
def test_the_step_cache_server_bench_runs_every_setting_the_server_has(server, tmp_path):
    """benchmarks/step_cache_server.py must not rot: one seed, 4 steps, on the random checkpoint (its
    images say nothing of quality; the digits checkpoint's do)."""
    from kiln.benchmarks import step_cache_server

    url, object_info, _ = server
    client = ComfyClient(url, timeout=900)
    result = step_cache_server.run(client, "v1-5-pruned-emaonly.safetensors", seeds=1, step_counts=(4,), mode="fast",
                                   folder=tmp_path, log=lambda msg: None)
    rows = {(r["group"], r["setting"]): r for r in result["rows"]}
    assert list(rows) == [(g, s) for g, s, _ in step_cache_server.settings(object_info, "fast")]
    assert rows[("kiln compile", "no cache")]["psnr_min"] >= 40   # Kiln's compile: the eager image
    assert rows[("eager", "kiln reuse default")]["psnr_min"] > 0
    assert all(r["seconds"] > 0 and 0 <= r["ssim_min"] <= 1.0 + 1e-6 for r in result["rows"])
