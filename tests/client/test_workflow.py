"""client/workflow.py: a handwritten UI-format workflow (a Note, a Reroute, a bypassed LoRA, a muted
preview, a seed with its 'control after generate' value, a widget fed by a node) converted as ComfyUI's
frontend converts it (the same file through frontend 1.35's graphToPrompt gives UI_EXPECTED), and
check_prompt's problems, each naming node and class."""
import json
from pathlib import Path

import pytest

from fake_comfy import OBJECT_INFO, UI_EXPECTED, UI_WORKFLOW, object_info_from_classes, out, socket, ui_node
from kiln.client.workflow import KILN_COMPILE_NODES, WorkflowError, check_prompt, is_ui_format, ui_to_api, without_nodes


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
