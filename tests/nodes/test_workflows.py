"""The example workflows (API format) name real nodes with inputs those nodes declare."""
import json
from pathlib import Path

import pytest

from kiln.nodes import NODE_CLASS_MAPPINGS

WORKFLOWS = sorted((Path(__file__).parents[2] / "workflows").glob("*_api.json"))
CORE = {"CheckpointLoaderSimple", "EmptyLatentImage", "CLIPTextEncode", "KSampler", "VAEDecode", "SaveImage",
        "LoraLoaderModelOnly", "UNETLoader"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_nodes_and_links(path):
    workflow = json.loads(path.read_text())
    for node_id, node in workflow.items():
        kind = node["class_type"]
        assert kind in NODE_CLASS_MAPPINGS or kind in CORE, f"{path.name} node {node_id}: unknown {kind}"
        for name, value in node["inputs"].items():
            if isinstance(value, list):  # a link: [source node id, output index]
                assert value[0] in workflow, f"{path.name} node {node_id}.{name} links to missing node {value[0]}"
        if kind in NODE_CLASS_MAPPINGS:
            try:
                declared = NODE_CLASS_MAPPINGS[kind].INPUT_TYPES()
            except ImportError:  # lists ComfyUI's model folders: checked on a real server
                continue
            names = {**declared["required"], **declared.get("optional", {})}
            assert set(node["inputs"]) <= set(names), f"{path.name} node {node_id}: {set(node['inputs']) - set(names)}"
            assert set(declared["required"]) <= set(node["inputs"]), f"{path.name} node {node_id} misses a required input"


def test_every_kiln_node_is_in_an_example():
    used = {node["class_type"] for path in WORKFLOWS for node in json.loads(path.read_text()).values()}
    assert set(NODE_CLASS_MAPPINGS) <= used
