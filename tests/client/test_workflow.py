"""client/workflow.py: a handwritten UI-format workflow (a Note, a Reroute, a bypassed LoRA, a muted
preview, a seed with its 'control after generate' value, a widget fed by a node) converted as ComfyUI's
frontend converts it (the same file through frontend 1.35's graphToPrompt gives UI_EXPECTED), and
check_prompt's problems, each naming node and class; a hostile workflow file or shape (UI or API format)
refused with the node and field named, and its text shown without control characters."""
import json
from pathlib import Path

import pytest

from fake_comfy import OBJECT_INFO, UI_EXPECTED, UI_WORKFLOW, object_info_from_classes, out, socket, ui_node
from kiln.client.workflow import (KILN_COMPILE_NODES, WorkflowError, check_api_workflow, check_prompt, is_ui_format,
                                  load_workflow, problems_shown, ui_to_api, without_nodes)


def test_a_ui_workflow_converts_as_the_frontend_does():
    assert is_ui_format(UI_WORKFLOW) and not is_ui_format(UI_EXPECTED)
    assert ui_to_api(UI_WORKFLOW, OBJECT_INFO) == UI_EXPECTED
    assert check_prompt(UI_EXPECTED, OBJECT_INFO) == []


def test_a_combo_with_control_after_generate_stores_two_more_values():
    image = ui_node(1, "EmptyLatentImage", outputs=[out("LATENT", "LATENT", 0, [])], widgets=[64, 64, 1])
    blend = ui_node(2, "ImageBlend", inputs=[socket("image1", "IMAGE"), socket("image2", "IMAGE")],
                    widgets=[0.3, "multiply", "fixed", ""])
    seeded = ui_node(3, "KSampler", widgets=[7, "fixed", 4, 6.5, "dpmpp_2m", "karras", 0.5])
    api = ui_to_api({"nodes": [image, blend, seeded], "links": []}, OBJECT_INFO)
    assert api["2"]["inputs"] == {"blend_factor": 0.3, "blend_mode": "multiply"}
    assert api["3"]["inputs"] == {"seed": 7, "steps": 4, "cfg": 6.5, "sampler_name": "dpmpp_2m", "scheduler": "karras",
                                  "denoise": 0.5}


def test_a_bypassed_node_with_no_input_of_the_type_passes_nothing():
    # A bypassed VAEDecode has no IMAGE input: the SaveImage after it gets no images (the frontend drops it too).
    nodes = [ui_node(1, "EmptyLatentImage", outputs=[out("LATENT", "LATENT", 0, [1])], widgets=[64, 64, 1]),
             ui_node(2, "VAEDecode", inputs=[socket("samples", "LATENT", 1), socket("vae", "VAE")],
                     outputs=[out("IMAGE", "IMAGE", 0, [2])], mode=4),
             ui_node(3, "SaveImage", inputs=[socket("images", "IMAGE", 2)], widgets=["x"])]
    links = [[1, 1, 0, 2, 0, "LATENT"], [2, 2, 0, 3, 0, "IMAGE"]]
    api = ui_to_api({"nodes": nodes, "links": links}, OBJECT_INFO)
    assert api["3"]["inputs"] == {"filename_prefix": "x"}
    assert check_prompt(api, OBJECT_INFO) == ["node 3 (SaveImage): required input 'images' is missing"]


def test_nodes_the_server_lacks_are_named():
    workflow = json.loads(json.dumps(UI_WORKFLOW))
    workflow["nodes"][0]["type"] = "FancyLoader"
    workflow["nodes"].append(ui_node(20, "SetNode", widgets=["x"]))
    workflow["nodes"].append(ui_node(21, "GoneNode", mode=2))  # muted: never sent, so not an error
    with pytest.raises(WorkflowError) as caught:
        ui_to_api(workflow, OBJECT_INFO)
    assert str(caught.value).splitlines() == [
        "the server has no node 'FancyLoader' (node 4): is its node pack installed?",
        "the server has no node 'SetNode' (node 20): is its node pack installed?"]


def test_broken_links_and_subgraphs_are_errors():
    workflow = json.loads(json.dumps(UI_WORKFLOW))
    workflow["links"] = [link for link in workflow["links"] if link[0] != 7]
    with pytest.raises(WorkflowError, match="node 3 input 'positive': link 7 is not in the workflow's links"):
        ui_to_api(workflow, OBJECT_INFO)
    with pytest.raises(WorkflowError, match="subgraphs"):
        ui_to_api({**UI_WORKFLOW, "definitions": {"subgraphs": [{"id": "x"}]}}, OBJECT_INFO)


def test_widget_values_saved_by_name():
    node = ui_node(1, "EmptyLatentImage", outputs=[out("LATENT", "LATENT", 0, [])])
    node["widgets_values"] = {"width": 320, "batch_size": 2}
    assert ui_to_api({"nodes": [node], "links": []}, OBJECT_INFO)["1"]["inputs"] == {"width": 320, "batch_size": 2}


def test_check_prompt_names_each_problem():
    prompt = json.loads(json.dumps(UI_EXPECTED))
    prompt["4"]["inputs"]["ckpt_name"] = "sd_xl_base_1.0.safetensors"
    prompt["3"]["inputs"]["sampler_name"] = "euler_fast"
    prompt["3"]["inputs"]["positive"] = ["5", 0]      # LATENT into CONDITIONING
    prompt["3"]["inputs"]["negative"] = ["7", 3]      # no output 3
    prompt["8"]["inputs"]["vae"] = ["99", 0]          # no node 99
    del prompt["3"]["inputs"]["latent_image"]
    prompt["5"]["inputs"]["depth"] = 3
    prompt["9"]["inputs"]["prompt"] = {}              # hidden inputs are allowed
    prompt["15"] = {"class_type": "FancySampler", "inputs": {}}
    assert check_prompt(prompt, OBJECT_INFO) == [
        "node 3 (KSampler): required input 'latent_image' is missing",
        "node 3 (KSampler): input 'sampler_name' is 'euler_fast', which is not one of its options (euler, dpmpp_2m)",
        "node 3 (KSampler): input 'positive' takes CONDITIONING, but output 0 of node 5 (EmptyLatentImage) gives LATENT",
        "node 3 (KSampler): input 'negative' links to output 3 of node 7 (CLIPTextEncode), which has 1 output(s)",
        "node 4 (CheckpointLoaderSimple): the server has no model named 'sd_xl_base_1.0.safetensors' in checkpoints "
        "(input ckpt_name; it has rand_sd15_tiny.safetensors)",
        "node 5 (EmptyLatentImage): unknown input 'depth' (it takes: width, height, batch_size)",
        "node 8 (VAEDecode): input 'vae' links to node 99, which the prompt does not have",
        "the server has no node 'FancySampler' (node 15): is its node pack installed?",
    ]


def test_link_types_any_and_lists_match():
    info = {**OBJECT_INFO, "Mask": {"input": {"required": {"pixels": ["IMAGE,MASK"], "anything": ["*"]}},
                                    "output": [], "output_name": []}}
    prompt = {"8": UI_EXPECTED["8"], "3": UI_EXPECTED["3"], "4": UI_EXPECTED["4"], "5": UI_EXPECTED["5"],
              "6": UI_EXPECTED["6"], "7": UI_EXPECTED["7"], "14": UI_EXPECTED["14"],
              "1": {"class_type": "Mask", "inputs": {"pixels": ["8", 0], "anything": ["3", 0]}}}
    assert check_prompt(prompt, info) == []
    prompt["1"]["inputs"]["pixels"] = ["3", 0]
    assert check_prompt(prompt, info) == [
        "node 1 (Mask): input 'pixels' takes IMAGE,MASK, but output 0 of node 3 (KSampler) gives LATENT"]


class Loader:
    CATEGORY = "Kiln"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_NODE = True
    DESCRIPTION = "loads"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"name": (["a.safetensors"], {"default": "a.safetensors"}), "strength": ("FLOAT",)},
                "optional": {"extra": ("STRING", {"multiline": True})}, "hidden": {"unique_id": "UNIQUE_ID"}}


class NeedsComfy:
    RETURN_TYPES = ()

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths_that_is_not_here  # noqa: F401


def test_object_info_from_classes_has_the_servers_shape():
    info = object_info_from_classes({"KilnLoader": Loader}, {"KilnLoader": "Kiln › Loader"})["KilnLoader"]
    assert info == {
        "input": {"required": {"name": [["a.safetensors"], {"default": "a.safetensors"}], "strength": ["FLOAT"]},
                  "optional": {"extra": ["STRING", {"multiline": True}]}, "hidden": {"unique_id": "UNIQUE_ID"}},
        "input_order": {"required": ["name", "strength"], "optional": ["extra"], "hidden": ["unique_id"]},
        "output": ["MODEL", "STRING"], "output_is_list": [False, False], "output_name": ["model", "report"],
        "name": "KilnLoader", "display_name": "Kiln › Loader", "description": "loads", "python_module": "nodes",
        "category": "Kiln", "output_node": True}
    with pytest.raises(ImportError, match="NeedsComfy.INPUT_TYPES\\(\\) needs ComfyUI"):
        object_info_from_classes({"NeedsComfy": NeedsComfy})


def test_kilns_own_nodes_check_against_their_definitions():
    from kiln.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    classes = {name: cls for name, cls in NODE_CLASS_MAPPINGS.items() if name != "KilnLoadQuantizedModel"}
    info = object_info_from_classes(classes, NODE_DISPLAY_NAME_MAPPINGS)
    assert info["KilnCompileUNet"]["input_order"]["required"] == ["model", "mode", "dynamic", "cuda_graphs"]
    prompt = {"1": {"class_type": "KilnCompileUNet", "inputs": {"model": ["1", 0], "mode": "fast", "dynamic": "auto",
                                                                 "cuda_graphs": False}}}
    assert check_prompt(prompt, info) == []
    prompt["1"]["inputs"]["mode"] = "ludicrous"
    assert check_prompt(prompt, info) == [
        "node 1 (KilnCompileUNet): input 'mode' is 'ludicrous', which is not one of its options (fast, balanced, max)"]


def test_an_upload_buttons_value_comes_after_all_the_widgets():
    # ComfyUI's frontend adds the upload button as an input of its own, after every input in input_order:
    # LoadImageMask saves [image, channel, "image"].
    info = {"LoadImageMask": {"input": {"required": {"image": [["a.png", "b.png"], {"image_upload": True}],
                                                     "channel": [["alpha", "red"]]}},
                              "input_order": {"required": ["image", "channel"]}, "output": ["MASK"]}}
    node = ui_node(1, "LoadImageMask", outputs=[out("MASK", "MASK", 0, [])], widgets=["b.png", "red", "image"])
    assert ui_to_api({"nodes": [node], "links": []}, info)["1"]["inputs"] == {"image": "b.png", "channel": "red"}
    assert check_prompt({"1": {"class_type": "LoadImageMask", "inputs": {"image": "c.png", "channel": "red"}}}, info) == [
        "node 1 (LoadImageMask): the server has no input image named 'c.png' (input image; it has a.png, b.png)"]


def test_without_nodes_takes_kilns_compile_nodes_out_and_rewires_their_consumers():
    prompt = json.loads((Path(__file__).parents[2] / "workflows" / "api" / "kiln_sd15_all_api.json").read_text())
    eager = without_nodes(prompt, KILN_COMPILE_NODES)
    assert {v["class_type"] for v in eager.values()} == {v["class_type"] for v in prompt.values()} - set(KILN_COMPILE_NODES)
    assert "KilnQuantizeModel" in {v["class_type"] for v in eager.values()}  # changes the weights: stays
    for node in eager.values():
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in eager, (node, value)
    sampler = next(v for v in eager.values() if v["class_type"] == "KSampler")
    assert eager[sampler["inputs"]["model"][0]]["class_type"] == "KilnQuantizeModel"
    decode = next(v for v in eager.values() if v["class_type"] == "VAEDecode")
    assert eager[decode["inputs"]["vae"][0]]["class_type"] == "CheckpointLoaderSimple"
    assert prompt != eager and any(v["class_type"] == "KilnCompileUNet" for v in prompt.values())  # a copy


def test_without_nodes_names_a_node_with_nothing_to_pass_through():
    prompt = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
              "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0]}}}
    with pytest.raises(WorkflowError, match=r"node 1 \(EmptyLatentImage\) has no linked input"):
        without_nodes(prompt, {"EmptyLatentImage"})


# -- a hostile workflow: every shape kiln indexes is checked first, the error naming the node and field

def api_prompt_with(edit) -> dict:
    prompt = json.loads(json.dumps(UI_EXPECTED))
    edit(prompt)
    return prompt


@pytest.mark.parametrize("edit, says", [
    (lambda p: p["3"].__setitem__("inputs", [1]), "workflow node 3: 'inputs' must be a JSON object, not a list"),
    (lambda p: p["3"].pop("inputs"), "workflow node 3: no 'inputs' (a JSON object of input name -> value, {} for none)"),
    (lambda p: p["3"].__setitem__("class_type", ["KSampler"]), "workflow node 3: 'class_type' must be a node's name, "
                                                               "not ['KSampler']"),
    (lambda p: p["3"].__setitem__("class_type", ""), "workflow node 3: 'class_type' must be a node's name, not ''"),
    (lambda p: p["3"].pop("class_type"), "workflow node 3: no 'class_type' (is this an API-format workflow?)"),
    (lambda p: p["3"].__setitem__("_meta", "oops"), "workflow node 3: '_meta' must be a JSON object, not a string"),
    (lambda p: p["3"].__setitem__("_meta", {"title": 7}), "workflow node 3: '_meta' 'title' must be a string, not a number"),
    (lambda p: p.__setitem__("10", 5), "workflow node 10: must be a JSON object with 'class_type' and 'inputs', not a "
                                       "number (is this an API-format workflow?)"),
    (lambda p: p.__setitem__("n" * 201, p.pop("3")), "its id is 201 characters long (the most kiln takes is 200)"),
    (lambda p: p.__setitem__("3\x1b[2J", p.pop("3")), "workflow node '3\\x1b[2J': its id has control characters"),
    (lambda p: p.__setitem__("", p.pop("3")), "workflow node '': its id is empty"),
], ids=["inputs-a-list", "no-inputs", "class_type-a-list", "class_type-empty", "no-class_type", "meta-a-string",
        "title-a-number", "node-a-number", "id-too-long", "id-escape", "id-empty"])
def test_an_api_workflow_of_the_wrong_shape_names_node_and_field(edit, says):
    prompt = api_prompt_with(edit)
    with pytest.raises(WorkflowError) as caught:
        check_api_workflow(prompt)
    assert says in str(caught.value) and "\x1b" not in str(caught.value)
    assert says in "\n".join(check_prompt(prompt, OBJECT_INFO))  # check_prompt says it too, and does not crash


def test_a_ui_workflow_is_not_taken_for_an_api_one():
    with pytest.raises(WorkflowError, match="this is a UI-format workflow: export it with 'Save \\(API\\)'"):
        check_api_workflow(UI_WORKFLOW)


def test_node_ids_of_non_ascii_digits_sort_as_text():
    # '²'.isdigit() is True but int('²') fails: ids are ordered as numbers only when they are ASCII digits
    prompt = api_prompt_with(lambda p: p.__setitem__("\u00b2", p.pop("9")))
    check_api_workflow(prompt)
    assert check_prompt(prompt, OBJECT_INFO) == []
    prompt["\u00b2"]["class_type"] = "Gone"
    assert check_prompt(prompt, OBJECT_INFO)[-1] == "the server has no node 'Gone' (node \u00b2): is its node pack installed?"


def ui_workflow_with(edit) -> dict:
    workflow = json.loads(json.dumps(UI_WORKFLOW))
    edit(workflow)
    return workflow


def ksampler(workflow) -> dict:
    return next(node for node in workflow["nodes"] if node["id"] == 3)


@pytest.mark.parametrize("edit, says", [
    (lambda w: w.__setitem__("nodes", [{"type": "KSampler"}]), "workflow 'nodes' entry 0: no 'id'"),
    (lambda w: w.__setitem__("nodes", [7]), "workflow 'nodes' entry 0: must be a JSON object (a node), not a number: 7"),
    (lambda w: w["nodes"][0].__setitem__("id", [4]), "workflow 'nodes' entry 0: 'id' must be a whole number or a string, "
                                                     "not a list"),
    (lambda w: w["nodes"][1].__setitem__("id", 4), "workflow node 4: two nodes in 'nodes' have this id"),
    (lambda w: ksampler(w).pop("type"), "workflow node 3: 'type' must be a node's name, not None"),
    (lambda w: ksampler(w).__setitem__("widgets_values", "42"), "workflow node 3: 'widgets_values' must be a list or "
                                                                "a JSON object, not a string"),
    (lambda w: ksampler(w).__setitem__("mode", "4"), "workflow node 3: 'mode' must be a whole number, not a string"),
    (lambda w: ksampler(w).__setitem__("inputs", [5]), "workflow node 3: 'inputs' entry 0 must be a JSON object, not a number"),
    (lambda w: ksampler(w)["inputs"][0].__setitem__("link", [4]), "workflow node 3: input 'model': 'link' must be a "
                                                                  "link's id (a whole number) or null, not a list"),
    (lambda w: ksampler(w)["inputs"][0].pop("name"), "workflow node 3: 'inputs' entry 0: 'name' must be a string, not null"),
    (lambda w: ksampler(w).__setitem__("outputs", [None]), "workflow node 3: 'outputs' entry 0 must be a JSON object, not null"),
    (lambda w: w["links"].__setitem__(0, [1]), "workflow 'links' entry 0: must be [id, origin node, origin slot, target "
                                               "node, target slot, type] or a JSON object, not [1]"),
    (lambda w: w["links"].__setitem__(0, [1, 4, "0", 10, 0, "MODEL"]), "workflow 'links' entry 0: its origin slot must "
                                                                       "be a whole number from 0, not '0'"),
    (lambda w: w["links"].__setitem__(0, [1, 4, -1, 10, 0, "MODEL"]), "its origin slot must be a whole number from 0, not -1"),
    (lambda w: w["links"].__setitem__(0, {"id": 1, "origin_id": 4}), "workflow 'links' entry 0: its origin slot must be "
                                                                     "a whole number from 0, not None"),
    (lambda w: w["links"].__setitem__(0, [[1], 4, 0]), "workflow 'links' entry 0: its id must be a whole number, not [1]"),
    (lambda w: w["links"].__setitem__(0, [1, None, 0]), "workflow 'links' entry 0: its origin node must be a node id, "
                                                        "not None"),
    (lambda w: w.__setitem__("links", {"1": [1, 4, 0]}), "workflow 'links' must be a list, not a JSON object"),
    (lambda w: w.__setitem__("definitions", []), "workflow 'definitions' must be a JSON object, not a list"),
], ids=["node-without-id", "node-a-number", "id-a-list", "two-nodes-one-id", "no-type", "widgets_values-a-string",
        "mode-a-string", "input-a-number", "link-a-list", "input-without-name", "output-null", "link-too-short",
        "slot-a-string", "slot-negative", "link-object-without-slot", "link-id-a-list", "origin-null", "links-an-object",
        "definitions-a-list"])
def test_a_ui_workflow_of_the_wrong_shape_names_node_and_field(edit, says):
    with pytest.raises(WorkflowError) as caught:
        ui_to_api(ui_workflow_with(edit), OBJECT_INFO)
    assert str(caught.value) == says or says in str(caught.value), str(caught.value)


def test_a_primitive_nodes_value_saved_by_name_is_an_error_not_a_crash():
    workflow = {"nodes": [ui_node(1, "PrimitiveNode", outputs=[out("INT", "INT", 0, [1])]),
                          ui_node(2, "EmptyLatentImage", inputs=[socket("width", "INT", 1, widget=True)],
                                  outputs=[out("LATENT", "LATENT", 0, [])], widgets=[64, 64, 1])],
                "links": [[1, 1, 0, 2, 0, "INT"]]}
    workflow["nodes"][0]["widgets_values"] = {"value": 64}
    with pytest.raises(WorkflowError, match="node 2 input 'width': link 1 comes from PrimitiveNode 1, whose "
                                            "'widgets_values' must be a list, not a JSON object"):
        ui_to_api(workflow, OBJECT_INFO)


def test_what_the_workflow_and_the_server_say_reaches_the_terminal_without_control_characters():
    info = json.loads(json.dumps(OBJECT_INFO))
    info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"] = [["x\x1b[2J.safetensors", "y" * 500]]
    prompt = api_prompt_with(lambda p: p.__setitem__("12", {"class_type": "Evil\x1b]0;owned\x07", "inputs": {}}))
    prompt["4"]["inputs"]["ckpt_name"] = "m\x07" + "z" * 100000 + ".safetensors"
    prompt["5"]["inputs"]["depth\x1b[31m"] = 1
    problems = check_prompt(prompt, OBJECT_INFO | info)
    assert not any(c in "\n".join(problems) for c in "\x1b\x07") and max(map(len, problems)) < 1000
    assert problems[0].startswith("node 4 (CheckpointLoaderSimple): the server has no model named 'm?zzz")
    assert problems[0].endswith("in checkpoints (input ckpt_name; it has x?[2J.safetensors, " + "y" * 77 + "...)")
    assert "node 5 (EmptyLatentImage): unknown input 'depth?[31m'" in problems[1]
    assert problems[2] == "the server has no node 'Evil?]0;owned?' (node 12): is its node pack installed?"
    with pytest.raises(WorkflowError, match="the server has no node 'Evil\\?\\]0;owned\\?' \\(node 3\\)"):
        ui_to_api(ui_workflow_with(lambda w: ksampler(w).__setitem__("type", "Evil\x1b]0;owned\x07")), OBJECT_INFO)


def test_a_long_list_of_problems_is_cut_and_counted(monkeypatch):
    from kiln.client import workflow

    monkeypatch.setattr(workflow, "MAX_PROBLEMS_SHOWN", 3)
    assert problems_shown(["a", "b", "c"]) == ["a", "b", "c"]
    assert problems_shown(list("abcdef")) == ["a", "b", "c", "... and 3 more problem(s) not shown"]


# -- reading a workflow file

NESTED_101 = json.dumps({"1": {"inputs": {"x": json.loads("[" * 98 + "1" + "]" * 98)}}}).encode()  # 3 + 98 levels


@pytest.mark.parametrize("content, says", [
    (b"[" * 100000 + b"]" * 100000, "JSON nested more than 100 levels deep: not a ComfyUI workflow"),
    (NESTED_101, "JSON nested more than 100 levels deep: not a ComfyUI workflow"),
    (b"[" * 100 + b"]" * 100, "not a ComfyUI workflow (a JSON object of nodes)"),  # 100 levels: read, then refused
    (b'{"1": "\xff"}', "not UTF-8 text (invalid start byte at byte 7)"),
    (b"{nope", "Expecting property name enclosed in double quotes"),
    (b"[1, 2]", "not a ComfyUI workflow (a JSON object of nodes)"),
    (b"null", "not a ComfyUI workflow (a JSON object of nodes)"),
    (b" " * 101, "larger than 100 bytes: not a ComfyUI workflow"),
], ids=["nested-past-json", "nested-past-the-cap", "nested-to-the-cap", "not-utf8", "not-json", "not-an-object",
        "null", "too-large"])
def test_a_workflow_file_that_cannot_be_read_is_named(tmp_path, monkeypatch, content, says):
    from kiln.client import workflow

    if says.startswith("larger"):
        monkeypatch.setattr(workflow, "MAX_WORKFLOW_BYTES", 100)
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(WorkflowError) as caught:
        load_workflow(str(path))
    assert str(caught.value) == f"{path}: {says}" or str(caught.value).startswith(f"{path}: {says}"), str(caught.value)


def test_a_workflow_file_is_read_with_or_without_a_byte_order_mark(tmp_path):
    path = tmp_path / "api.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(UI_EXPECTED).encode())
    assert load_workflow(str(path)) == UI_EXPECTED
    with pytest.raises(WorkflowError, match=f"cannot read {tmp_path / 'gone.json'}: No such file or directory"):
        load_workflow(str(tmp_path / "gone.json"))
