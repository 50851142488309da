"""Kiln's example workflows: every family and variant the README promises exists in both formats, the
API files are what workflows/make_examples.py builds, each UI file describes the same graph as its API
twin (nodes, titles, links and their types, Kiln's widget values), and Kiln's nodes are wired with the
inputs they declare. Checks against core's node definitions, and runs in a real server, are in
tests/comfyui/test_comfy_workflows.py (they need a ComfyUI)."""
import importlib.util
import json
from pathlib import Path

import pytest

from kiln.client.workflow import input_specs, is_widget
from kiln.nodes import NODE_CLASS_MAPPINGS

FOLDER = Path(__file__).parents[2] / "workflows"
API_FOLDER = FOLDER / "api"
API_FILES = sorted(API_FOLDER.glob("*_api.json"))
UI_FILES = sorted(FOLDER.glob("*.json"))


def load_generator():
    spec = importlib.util.spec_from_file_location("make_examples", FOLDER / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_examples = load_generator()


def twin(ui_path: Path) -> dict:
    return json.loads((API_FOLDER / f"{ui_path.stem}_api.json").read_text())


def test_every_family_and_variant_exists_in_both_formats():
    stems = {p.stem for p in UI_FILES}
    assert {p.name[: -len("_api.json")] for p in API_FILES} == stems
    for family in ("sd15", "sdxl", "flux"):
        for variant in ("compile", "quantize", "cache", "all", "lora", "controlnet", "img2img"):
            assert f"kiln_{family}_{variant}" in stems


def test_the_api_files_are_what_the_generator_builds():
    built = make_examples.examples()
    assert set(built) == {p.name[: -len("_api.json")] for p in API_FILES}
    for stem, (api, _) in built.items():
        assert json.loads((API_FOLDER / f"{stem}_api.json").read_text()) == api, f"{stem}: run workflows/make_examples.py"


def test_the_user_model_names_are_the_ones_users_have():
    names = {value for path in API_FILES for node in json.loads(path.read_text()).values()
             for key, value in node["inputs"].items() if key in ("ckpt_name", "unet_name")}
    assert {"v1-5-pruned-emaonly.safetensors", "sd_xl_base_1.0.safetensors", "flux1-dev.safetensors"} <= names


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_a_ui_file_describes_the_same_graph_as_its_api_twin(path):
    ui, api = json.loads(path.read_text()), twin(path)
    nodes = {str(n["id"]): n for n in ui["nodes"]}
    notes = [n for n in ui["nodes"] if n["type"] == "Note"]
    assert len(notes) == 1 and notes[0]["widgets_values"][0].startswith("Kiln example: ")
    assert "First run" in notes[0]["widgets_values"][0] or "nothing is compiled" in notes[0]["widgets_values"][0]
    assert {k: n["type"] for k, n in nodes.items() if n["type"] != "Note"} == {k: v["class_type"] for k, v in api.items()}
    assert all(nodes[k]["title"] == v["_meta"]["title"] for k, v in api.items())
    api_links = {(node_id, name): tuple(value) for node_id, node in api.items()
                 for name, value in node["inputs"].items() if isinstance(value, list)}
    ui_links = {}
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        target = nodes[str(dst)]["inputs"][dst_slot]
        assert target["link"] == link_id and target["type"] in (kind, "*") or kind in target["type"].split(","), \
            f"{path.name}: link {link_id} carries {kind} into {target}"
        assert link_id in nodes[str(src)]["outputs"][src_slot]["links"]
        assert nodes[str(src)]["outputs"][src_slot]["type"] == kind
        ui_links[(str(dst), target["name"])] = (str(src), src_slot)
    assert ui_links == api_links
    groups = ui["groups"]
    assert groups and groups[0]["title"] == "Kiln" and all(
        inside(nodes[k]["pos"], groups[0]["bounding"]) for k, v in api.items() if v["class_type"].startswith("Kiln"))


def inside(pos, bounding) -> bool:
    x, y, w, h = bounding
    return x <= pos[0] <= x + w and y <= pos[1] <= y + h


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_kiln_widget_values_in_a_ui_file_are_its_twins_inputs(path):
    ui, api = json.loads(path.read_text()), twin(path)
    for node in ui["nodes"]:
        kind = node["type"]
        if kind not in NODE_CLASS_MAPPINGS:
            continue
        try:
            declared = NODE_CLASS_MAPPINGS[kind].INPUT_TYPES()
        except ImportError:  # lists ComfyUI's model folders: checked against a real server
            continue
        info = {"input": {k: v for k, v in declared.items() if k != "hidden"}}
        widgets = [name for name, spec in input_specs(info) if is_widget(spec)]
        assert dict(zip(widgets, node["widgets_values"])) == {
            k: v for k, v in api[str(node["id"])]["inputs"].items() if k in widgets}, f"{path.name} node {node['id']}"


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_kiln_nodes_get_the_inputs_they_declare(path):
    workflow = json.loads(path.read_text())
    for node_id, node in workflow.items():
        for name, value in node["inputs"].items():
            if isinstance(value, list):  # a link: [source node id, output index]
                assert value[0] in workflow, f"{path.name} node {node_id}.{name} links to missing node {value[0]}"
        if node["class_type"] in NODE_CLASS_MAPPINGS:
            try:
                declared = NODE_CLASS_MAPPINGS[node["class_type"]].INPUT_TYPES()
            except ImportError:
                continue
            names = {**declared["required"], **declared.get("optional", {})}
            assert set(node["inputs"]) <= set(names), f"{path.name} node {node_id}: {set(node['inputs']) - set(names)}"
            assert set(declared["required"]) <= set(node["inputs"]), f"{path.name} node {node_id} misses a required input"


def test_every_kiln_node_is_in_an_example():
    used = {node["class_type"] for path in API_FILES for node in json.loads(path.read_text()).values()}
    assert set(NODE_CLASS_MAPPINGS) <= used
