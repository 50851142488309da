"""client/workflow.py: a handwritten UI-format workflow (a Note, a Reroute, a bypassed LoRA, a muted
preview, a seed with its 'control after generate' value, a widget fed by a node) converted as ComfyUI's
frontend converts it (the same file through frontend 1.35's graphToPrompt gives UI_EXPECTED), and
check_prompt's problems, each naming node and class."""
import json

import pytest

from kiln.client.workflow import (WorkflowError, check_prompt, is_ui_format, object_info_from_classes,
                                  ui_to_api)

# Core definitions as ComfyUI 0.8's /object_info gives them (tooltips left out).
OBJECT_INFO = {
    "CheckpointLoaderSimple": {"input": {"required": {"ckpt_name": [["rand_sd15_tiny.safetensors"], {}]}},
                               "input_order": {"required": ["ckpt_name"]}, "output": ["MODEL", "CLIP", "VAE"],
                               "output_name": ["MODEL", "CLIP", "VAE"], "display_name": "Load Checkpoint"},
    "LoraLoader": {"input": {"required": {"model": ["MODEL"], "clip": ["CLIP"],
                                          "lora_name": [["rand_lora_tiny.safetensors"]],
                                          "strength_model": ["FLOAT", {"default": 1.0}],
                                          "strength_clip": ["FLOAT", {"default": 1.0}]}},
                   "input_order": {"required": ["model", "clip", "lora_name", "strength_model", "strength_clip"]},
                   "output": ["MODEL", "CLIP"], "output_name": ["MODEL", "CLIP"], "display_name": "Load LoRA"},
    "CLIPTextEncode": {"input": {"required": {"text": ["STRING", {"multiline": True}], "clip": ["CLIP"]}},
                       "input_order": {"required": ["text", "clip"]}, "output": ["CONDITIONING"],
                       "output_name": ["CONDITIONING"], "display_name": "CLIP Text Encode (Prompt)"},
    "EmptyLatentImage": {"input": {"required": {"width": ["INT", {"default": 512}], "height": ["INT", {"default": 512}],
                                                "batch_size": ["INT", {"default": 1}]}},
                         "input_order": {"required": ["width", "height", "batch_size"]}, "output": ["LATENT"],
                         "output_name": ["LATENT"], "display_name": "Empty Latent Image"},
    "KSampler": {"input": {"required": {"model": ["MODEL"], "seed": ["INT", {"control_after_generate": True}],
                                        "steps": ["INT", {"default": 20}], "cfg": ["FLOAT", {"default": 8.0}],
                                        "sampler_name": [["euler", "dpmpp_2m"]], "scheduler": [["normal", "karras"]],
                                        "positive": ["CONDITIONING"], "negative": ["CONDITIONING"],
                                        "latent_image": ["LATENT"], "denoise": ["FLOAT", {"default": 1.0}]}},
                 "input_order": {"required": ["model", "seed", "steps", "cfg", "sampler_name", "scheduler", "positive",
                                              "negative", "latent_image", "denoise"]},
                 "output": ["LATENT"], "output_name": ["LATENT"], "display_name": "KSampler"},
    "VAEDecode": {"input": {"required": {"samples": ["LATENT"], "vae": ["VAE"]}},
                  "input_order": {"required": ["samples", "vae"]}, "output": ["IMAGE"], "output_name": ["IMAGE"],
                  "display_name": "VAE Decode"},
    "SaveImage": {"input": {"required": {"images": ["IMAGE"], "filename_prefix": ["STRING", {"default": "ComfyUI"}]},
                            "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}},
                  "input_order": {"required": ["images", "filename_prefix"], "hidden": ["prompt", "extra_pnginfo"]},
                  "output": [], "output_name": [], "output_node": True, "display_name": "Save Image"},
    "PreviewImage": {"input": {"required": {"images": ["IMAGE"]}}, "input_order": {"required": ["images"]},
                     "output": [], "output_name": [], "output_node": True, "display_name": "Preview Image"},
    "PrimitiveInt": {"input": {"required": {"value": ["INT", {"control_after_generate": True}]}},
                     "input_order": {"required": ["value"]}, "output": ["INT"], "output_name": ["INT"],
                     "display_name": "Int"},
    "ImageBlend": {"input": {"required": {"image1": ["IMAGE"], "image2": ["IMAGE"],
                                          "blend_factor": ["FLOAT", {"default": 0.5}],
                                          "blend_mode": [["normal", "multiply"], {"control_after_generate": True}]}},
                   "input_order": {"required": ["image1", "image2", "blend_factor", "blend_mode"]},
                   "output": ["IMAGE"], "output_name": ["IMAGE"], "display_name": "Image Blend"},
}


def ui_node(node_id, kind, inputs=(), outputs=(), widgets=(), mode=0, title=None):
    node = {"id": node_id, "type": kind, "pos": [100 * node_id, 100], "size": [300, 120], "flags": {},
            "order": node_id, "mode": mode, "inputs": list(inputs), "outputs": list(outputs),
            "properties": {"Node name for S&R": kind}, "widgets_values": list(widgets)}
    if title:
        node["title"] = title
    return node


def socket(name, kind, link=None, widget=False):
    entry = {"name": name, "type": kind, "link": link}
    if widget:
        entry["widget"] = {"name": name}
    return entry


def out(name, kind, slot, links):
    return {"name": name, "type": kind, "links": links, "slot_index": slot}


# A txt2img graph as ComfyUI's frontend 1.35 saves it. The LoRA (10) is bypassed: MODEL and CLIP go
# through it from the checkpoint. The VAE goes through a Reroute (11). The sampler's steps come from an
# Int node (14) into its steps widget, which keeps its place in widgets_values. A preview (13) is muted.
UI_WORKFLOW = {
    "id": "0b7c5e64-6a7a-4c43-9a55-6f7f1a3a0c11", "revision": 0, "last_node_id": 14, "last_link_id": 16,
    "nodes": [
        ui_node(4, "CheckpointLoaderSimple", outputs=[out("MODEL", "MODEL", 0, [1]), out("CLIP", "CLIP", 1, [2]),
                                                      out("VAE", "VAE", 2, [3])],
                widgets=["rand_sd15_tiny.safetensors"]),
        ui_node(10, "LoraLoader", inputs=[socket("model", "MODEL", 1), socket("clip", "CLIP", 2)],
                outputs=[out("MODEL", "MODEL", 0, [4]), out("CLIP", "CLIP", 1, [5, 6])],
                widgets=["rand_lora_tiny.safetensors", 0.8, 0.8], mode=4),
        ui_node(6, "CLIPTextEncode", inputs=[socket("clip", "CLIP", 5)],
                outputs=[out("CONDITIONING", "CONDITIONING", 0, [7])], widgets=["a red fox in the snow"],
                title="Positive"),
        ui_node(7, "CLIPTextEncode", inputs=[socket("clip", "CLIP", 6)],
                outputs=[out("CONDITIONING", "CONDITIONING", 0, [8])], widgets=["blurry"], title="Negative"),
        ui_node(5, "EmptyLatentImage", outputs=[out("LATENT", "LATENT", 0, [9])], widgets=[256, 256, 1]),
        ui_node(14, "PrimitiveInt", outputs=[out("INT", "INT", 0, [16])], widgets=[3, "fixed"]),
        ui_node(3, "KSampler", inputs=[socket("model", "MODEL", 4), socket("positive", "CONDITIONING", 7),
                                       socket("negative", "CONDITIONING", 8), socket("latent_image", "LATENT", 9),
                                       socket("steps", "INT", 16, widget=True)],
                outputs=[out("LATENT", "LATENT", 0, [10])],
                widgets=[42, "randomize", 20, 7.0, "euler", "normal", 1.0]),
        ui_node(11, "Reroute", inputs=[socket("", "*", 3)], outputs=[out("", "VAE", 0, [11])]),
        ui_node(8, "VAEDecode", inputs=[socket("samples", "LATENT", 10), socket("vae", "VAE", 11)],
                outputs=[out("IMAGE", "IMAGE", 0, [12, 13])]),
        ui_node(9, "SaveImage", inputs=[socket("images", "IMAGE", 12)], widgets=["kiln/queue"]),
        ui_node(13, "PreviewImage", inputs=[socket("images", "IMAGE", 13)], mode=2),
        ui_node(12, "Note", widgets=["Kiln queue test: a bypassed LoRA, a Reroute, a muted preview."]),
    ],
    "links": [[1, 4, 0, 10, 0, "MODEL"], [2, 4, 1, 10, 1, "CLIP"], [3, 4, 2, 11, 0, "VAE"],
              [4, 10, 0, 3, 0, "MODEL"], [5, 10, 1, 6, 0, "CLIP"], [6, 10, 1, 7, 0, "CLIP"],
              [7, 6, 0, 3, 1, "CONDITIONING"], [8, 7, 0, 3, 2, "CONDITIONING"], [9, 5, 0, 3, 3, "LATENT"],
              [10, 3, 0, 8, 0, "LATENT"], [11, 11, 0, 8, 1, "VAE"], [12, 8, 0, 9, 0, "IMAGE"],
              [13, 8, 0, 13, 0, "IMAGE"], [16, 14, 0, 3, 4, "INT"]],
    "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4,
}

UI_EXPECTED = {
    "3": {"inputs": {"seed": 42, "steps": ["14", 0], "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
                     "denoise": 1.0, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                     "latent_image": ["5", 0]},
          "class_type": "KSampler", "_meta": {"title": "KSampler"}},
    "4": {"inputs": {"ckpt_name": "rand_sd15_tiny.safetensors"}, "class_type": "CheckpointLoaderSimple",
          "_meta": {"title": "Load Checkpoint"}},
    "5": {"inputs": {"width": 256, "height": 256, "batch_size": 1}, "class_type": "EmptyLatentImage",
          "_meta": {"title": "Empty Latent Image"}},
    "6": {"inputs": {"text": "a red fox in the snow", "clip": ["4", 1]}, "class_type": "CLIPTextEncode",
          "_meta": {"title": "Positive"}},
    "7": {"inputs": {"text": "blurry", "clip": ["4", 1]}, "class_type": "CLIPTextEncode", "_meta": {"title": "Negative"}},
    "8": {"inputs": {"samples": ["3", 0], "vae": ["4", 2]}, "class_type": "VAEDecode", "_meta": {"title": "VAE Decode"}},
    "9": {"inputs": {"filename_prefix": "kiln/queue", "images": ["8", 0]}, "class_type": "SaveImage",
          "_meta": {"title": "Save Image"}},
    "14": {"inputs": {"value": 3}, "class_type": "PrimitiveInt", "_meta": {"title": "Int"}},
}


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
