"""Writes Kiln's example workflows: each in ComfyUI's UI format (what a user drags onto the canvas:
nodes with positions, links, a Kiln group and a Note) and its API twin in api/ (what `kiln queue` and
ComfyUI's /prompt take), for SD1.5, SDXL and Flux. ComfyUI's Templates browser lists the JSON files
directly in workflows/ and opens them as UI workflows, so the API twins live one folder down.

    python workflows/make_examples.py --object-info object_info.json   # or --server http://127.0.0.1:8188

The node definitions (widget order, input and output types) come from a ComfyUI's /object_info
with Kiln installed; the frontend's layout rules are kiln.client.workflow's (what `kiln queue` reads
UI files with). tests/nodes/test_workflows.py checks the files against the definitions, each UI
file against its twin, and runs the small ones in a real server.
"""
from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from kiln import __version__
from kiln.choices import DEFAULT_STEP_CACHE_METHOD, STEP_CACHE_SETTINGS
from kiln.client.workflow import extra_widget_values, input_specs, is_widget, spec_options, spec_type

HERE = Path(__file__).parent
API_FOLDER = "api"
# Kiln's nodes carry the pack's registry id and version, which the frontend offers to install when they are missing.
PACK_PROPERTIES = {"cnr_id": "comfyui-kiln", "ver": __version__}
IMAGE_PREVIEW_HEIGHT = 330  # the frontend's smallest size for a node that previews an uploaded image (LoadImage)

FAMILIES = {
    "sd15": dict(checkpoint="v1-5-pruned-emaonly.safetensors", size=(512, 512), steps=20, cfg=7.0,
                 scheduler="normal", controlnet="control_v11p_sd15_canny.pth", second_size=(768, 512),
                 quant="int8_weight", lora="sd15_lora.safetensors"),
    "sdxl": dict(checkpoint="sd_xl_base_1.0.safetensors", size=(1024, 1024), steps=25, cfg=7.0,
                 scheduler="normal", controlnet="controlnet-canny-sdxl-1.0.safetensors", second_size=(832, 1216),
                 quant="int8_weight", lora="sdxl_lora.safetensors"),
    "flux": dict(unet="flux1-dev.safetensors", clip=("clip_l.safetensors", "t5xxl_fp16.safetensors"),
                 vae="ae.safetensors", size=(1024, 1024), steps=20, cfg=1.0, scheduler="simple",
                 controlnet="flux-canny-controlnet-v3.safetensors", second_size=(832, 1216),
                 quant="fp8_e4m3", lora="flux_lora.safetensors"),
}
VARIANTS = ("compile", "quantize", "cache", "all", "lora", "controlnet", "img2img", "step_cache")
FAMILY_NAMES = {"sd15": "SD1.5", "sdxl": "SDXL", "flux": "Flux dev"}

FIRST_RUN = ("First run: the first sampling step compiles (the progress bar shows it, and Compile UNet shows each "
             "graph and its time on itself); later prompts start at once. Batch size and resolution changes reuse "
             "the dynamic graph; a change that needs a new graph compiles once and the node says why.")
NOTES = {
    "compile": "Kiln › Compile UNet compiles the diffusion model on its first sampling step. mode balanced is the "
               "default; fast compiles in seconds (no Inductor), max takes longest and runs fastest.",
    "quantize": "Kiln › Quantize Model stores the diffusion model's weights in {quant} (about half the memory or "
                "less), keeping the first and last layers and the embeddings; its report lists every layer and why. "
                "Compile UNet then compiles the quantized model.",
    "cache": "Kiln › Cache Graph keeps each compiled graph on disk (ComfyUI/user/kiln-cache, signed, private): "
             "after a restart the same model and settings load in seconds instead of compiling. The node shows each "
             "hit or miss and why. `kiln warm` fills it ahead for a list of sizes.",
    "all": "Quantize Model, then Cache Graph, then Compile UNet: one Kiln plan (quantize, then compile, cached). "
           "Kiln › Compile VAE compiles the VAE's decode too.",
    "lora": "The LoRA is applied after Compile UNet: Kiln's compiled model reads the patched weights, so changing "
            "the LoRA or its strength does not recompile.",
    "controlnet": "Kiln › Compile ControlNet compiles the ControlNet's network; changing its strength (0 included) "
                  "or the hint image does not recompile. Put your control image in LoadImage.",
    "step_cache": "Kiln › Step Cache skips the sampling steps whose model output would change little (late in "
                  "sampling), reusing the last computed step's; after each run it shows how many model calls it "
                  "computed and skipped. threshold -1 is the method's default, 0 never skips; higher skips more "
                  "and drifts further from the uncached image. method first_block decides by the model's first "
                  "block (run every step). A new threshold does not recompile.",
    "img2img": "img2img at a second resolution: the image is scaled to {second}, encoded by the compiled VAE "
               "(Kiln › Compile VAE, decode and encode) and denoised at 0.6. The UNet graph compiled for txt2img "
               "serves this size too (dynamic resolution).",
}


class Graph:
    """An API-format workflow built node by node; ids are assigned in order, from 1."""

    def __init__(self):
        self.nodes: dict[str, dict] = {}

    def add(self, class_type: str, title: str = "", **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs,
                               "_meta": {"title": title or class_type}}
        return node_id


def out(node_id: str, slot: int = 0) -> list:
    return [node_id, slot]


def kiln_unet(g: Graph, model: list, family: str, variant: str) -> list:
    if variant in ("quantize", "all"):
        model = out(g.add("KilnQuantizeModel", "Kiln › Quantize Model", model=model, scheme=FAMILIES[family]["quant"],
                          policy="", calibration_steps=0, error_threshold=0.05))
    if variant in ("cache", "all"):
        model = out(g.add("KilnCacheGraph", "Kiln › Cache Graph", model=model, cache="use", cache_dir="", max_gb=20.0))
    model = out(g.add("KilnCompileUNet", "Kiln › Compile UNet", model=model, mode="balanced", dynamic="auto",
                      cuda_graphs=False, pin_shapes="", advanced=""))
    if variant == "step_cache":
        model = out(g.add("KilnStepCache", "Kiln › Step Cache", model=model, method=DEFAULT_STEP_CACHE_METHOD,
                          **{name: default for name, (default, _) in STEP_CACHE_SETTINGS.items()}))
    return model


def build(family: str, variant: str) -> dict:
    """The API-format workflow of one family and variant."""
    f = FAMILIES[family]
    g = Graph()
    if family == "flux":
        model = out(g.add("UNETLoader", "Load Diffusion Model", unet_name=f["unet"], weight_dtype="default"))
        clip = out(g.add("DualCLIPLoader", "DualCLIPLoader", clip_name1=f["clip"][0], clip_name2=f["clip"][1],
                         type="flux", device="default"))
        vae = out(g.add("VAELoader", "Load VAE", vae_name=f["vae"]))
    else:
        loader = g.add("CheckpointLoaderSimple", "Load Checkpoint", ckpt_name=f["checkpoint"])
        model, clip, vae = out(loader, 0), out(loader, 1), out(loader, 2)
    model = kiln_unet(g, model, family, variant)
    if variant == "lora":
        model = out(g.add("LoraLoaderModelOnly", "LoRA", model=model, lora_name=f["lora"], strength_model=0.8))
    if variant in ("all", "img2img"):
        vae = out(g.add("KilnCompileVAE", "Kiln › Compile VAE", vae=vae, mode="balanced",
                        compile="decode and encode" if variant == "img2img" else "decode"))
    positive = out(g.add("CLIPTextEncode", "Positive prompt", clip=clip,
                         text="a photograph of an astronaut riding a horse, golden hour"))
    negative = out(g.add("CLIPTextEncode", "Negative prompt", clip=clip,
                         text="" if family == "flux" else "blurry, low quality"))
    if family == "flux":
        positive = out(g.add("FluxGuidance", "FluxGuidance", conditioning=positive, guidance=3.5))
    denoise = 1.0
    if variant == "controlnet":
        image = out(g.add("LoadImage", "Control image", image="example.png"))
        hint = out(g.add("Canny", "Canny", image=image, low_threshold=0.4, high_threshold=0.8))
        control = out(g.add("ControlNetLoader", "Load ControlNet", control_net_name=f["controlnet"]))
        control = out(g.add("KilnCompileControlNet", "Kiln › Compile ControlNet", control_net=control,
                            mode="balanced", dynamic="auto"))
        apply = g.add("ControlNetApplyAdvanced", "Apply ControlNet", positive=positive, negative=negative,
                      control_net=control, image=hint, strength=0.8, start_percent=0.0, end_percent=1.0,
                      **({"vae": vae} if family == "flux" else {}))
        positive, negative = out(apply, 0), out(apply, 1)
    if variant == "img2img":
        width, height = f["second_size"]
        image = out(g.add("LoadImage", "Input image", image="example.png"))
        image = out(g.add("ImageScale", "Scale to the second size", image=image, upscale_method="bicubic",
                          width=width, height=height, crop="center"))
        latent = out(g.add("VAEEncode", "VAE Encode", pixels=image, vae=vae))
        denoise = 0.6
    else:
        width, height = f["size"]
        empty = "EmptySD3LatentImage" if family == "flux" else "EmptyLatentImage"
        latent = out(g.add(empty, "Empty latent", width=width, height=height, batch_size=1))
    samples = out(g.add("KSampler", "KSampler", model=model, seed=42, steps=f["steps"], cfg=f["cfg"],
                        sampler_name="euler", scheduler=f["scheduler"], positive=positive, negative=negative,
                        latent_image=latent, denoise=denoise))
    image = out(g.add("VAEDecode", "VAE Decode", samples=samples, vae=vae))
    g.add("SaveImage", "Save Image", images=image, filename_prefix=f"kiln/{family}_{variant}")
    return g.nodes


def build_quantized_files(kind: str) -> dict:
    """SD1.5: quantize to fp8 and save (kind 'save'), or load that file and sample (kind 'load')."""
    f = FAMILIES["sd15"]
    g = Graph()
    loader = g.add("CheckpointLoaderSimple", "Load Checkpoint", ckpt_name=f["checkpoint"])
    if kind == "save":
        model = out(g.add("KilnQuantizeModel", "Kiln › Quantize Model", model=out(loader), scheme="fp8_e4m3", policy="",
                          calibration_steps=0, error_threshold=0.05))
        g.add("KilnSaveQuantizedModel", "Kiln › Save Quantized Model", model=model, filename="kiln/sd15_fp8",
              overwrite=False)
        return g.nodes
    model = out(g.add("KilnLoadQuantizedModel", "Kiln › Load Quantized Model", unet_name="kiln/sd15_fp8.safetensors"))
    model = out(g.add("KilnCompileUNet", "Kiln › Compile UNet", model=model, mode="balanced", dynamic="auto",
                      cuda_graphs=False, pin_shapes="", advanced=""))
    positive = out(g.add("CLIPTextEncode", "Positive prompt", clip=out(loader, 1), text="a photograph of an astronaut"))
    negative = out(g.add("CLIPTextEncode", "Negative prompt", clip=out(loader, 1), text="blurry, low quality"))
    latent = out(g.add("EmptyLatentImage", "Empty latent", width=512, height=512, batch_size=1))
    samples = out(g.add("KSampler", "KSampler", model=model, seed=42, steps=20, cfg=7.0, sampler_name="euler",
                        scheduler="normal", positive=positive, negative=negative, latent_image=latent, denoise=1.0))
    image = out(g.add("VAEDecode", "VAE Decode", samples=samples, vae=out(loader, 2)))
    g.add("SaveImage", "Save Image", images=image, filename_prefix="kiln/sd15_fp8_loaded")
    return g.nodes


def note_text(family: str, variant: str) -> str:
    f = FAMILIES[family]
    files = (f"{f['unet']} (diffusion_models), {' and '.join(f['clip'])} (text_encoders), {f['vae']} (vae)"
             if family == "flux" else f"{f['checkpoint']} (checkpoints)")
    body = NOTES.get(variant, "").format(quant=f["quant"], second="x".join(map(str, f["second_size"])))
    return (f"Kiln example: {FAMILY_NAMES[family]}, {variant}.\n\n{body}\n\n{FIRST_RUN}\n\n"
            f"Models: {files}. Queue it headless with: kiln queue <this file> --out outputs/")


# ---- API -> UI ------------------------------------------------------------------------------

def widget_values(node: dict, info: dict) -> list:
    """A node's widgets_values as the frontend stores them: each widget's value (its default when the
    API node leaves it out), a seed's 'control after generate' after it, an upload button's last."""
    values, upload = [], []
    for name, spec in input_specs(info):
        value = node["inputs"].get(name)
        if not is_widget(spec) or isinstance(value, list):
            continue
        extra = extra_widget_values(name, spec)
        if extra > 1:
            raise ValueError(f"{node['class_type']}.{name}: a combo with 'control after generate' is not laid out here")
        values += [value if name in node["inputs"] else spec_options(spec).get("default")] + ["fixed"] * extra
        upload += ["image"] if spec_options(spec).get("image_upload") else []
    return values + upload


def depths(api: dict) -> dict[str, int]:
    """Each node's column: the longest chain of links leading to it."""
    memo: dict[str, int] = {}

    def depth(node_id: str) -> int:
        if node_id not in memo:
            links = [v[0] for v in api[node_id]["inputs"].values() if isinstance(v, list)]
            memo[node_id] = 1 + max((depth(src) for src in links), default=-1)
        return memo[node_id]

    for node_id in api:
        depth(node_id)
    return memo


def to_ui(api: dict, object_info: dict, note: str) -> dict:
    """The UI-format twin of an API-format workflow: same node ids, laid out in columns by depth, Kiln's
    nodes in a band of their own (framed by a group) above the rest."""
    columns = depths(api)
    links, nodes = [], []
    outputs_links: dict[tuple[str, int], list[int]] = {}
    for node_id, node in sorted(api.items(), key=lambda kv: (columns[kv[0]], int(kv[0]))):
        info = object_info[node["class_type"]]
        inputs, widgets = [], widget_values(node, info)
        for name, spec in input_specs(info):
            value = node["inputs"].get(name)
            if is_widget(spec) and not isinstance(value, list):
                continue
            entry = {"name": name, "type": spec_type(spec), "link": None}
            if isinstance(value, list):
                link_id = len(links) + 1
                src, slot = value
                links.append([link_id, int(src), slot, int(node_id), len(inputs),
                              object_info[api[src]["class_type"]]["output"][slot]])
                outputs_links.setdefault((src, slot), []).append(link_id)
                entry["link"] = link_id
            inputs.append(entry)
        height = 46 + 22 * max(len(inputs), len(info["output"])) + 26 * len(widgets)
        height += 100 * sum(isinstance(w, str) and len(w) > 30 for w in widgets)
        if any(spec_options(spec).get("image_upload") for _, spec in input_specs(info)):
            height = max(height, IMAGE_PREVIEW_HEIGHT)
        properties = {"Node name for S&R": node["class_type"]}
        if node["class_type"].startswith("Kiln"):
            properties.update(PACK_PROPERTIES)
        outputs = [{"name": name, "type": kind, "links": [], "slot_index": slot}
                   for slot, (name, kind) in enumerate(zip(info["output_name"], info["output"]))]
        nodes.append({"id": int(node_id), "type": node["class_type"], "pos": [40 + 380 * columns[node_id], 0],
                      "size": [340, height], "flags": {}, "order": len(nodes), "mode": 0, "inputs": inputs,
                      "outputs": outputs, "title": node["_meta"]["title"],
                      "properties": properties, "widgets_values": widgets})
    for ui in nodes:
        for output in ui["outputs"]:
            output["links"] = outputs_links.get((str(ui["id"]), output["slot_index"]), [])
    kiln = [n for n in nodes if n["type"].startswith("Kiln")]
    band_bottom = stack([n for n in nodes if n in kiln], top=380)
    stack([n for n in nodes if n not in kiln], top=band_bottom + 60)
    note_id = max(int(k) for k in api) + 1
    nodes.append({"id": note_id, "type": "Note", "pos": [40, 20], "size": [720, 280], "flags": {}, "order": len(nodes),
                  "mode": 0, "inputs": [], "outputs": [], "title": "About this workflow", "properties": {},
                  "widgets_values": [note], "color": "#432", "bgcolor": "#653"})
    return {"last_node_id": note_id, "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [kiln_group(kiln)] if kiln else [], "config": {},
            "extra": {"ds": {"scale": 0.7, "offset": [80, 40]}}, "version": 0.4}


def stack(nodes: list[dict], top: int) -> int:
    """Stack nodes down their columns from `top`; the lowest bottom edge."""
    bottom = {}
    for node in nodes:
        x = node["pos"][0]
        node["pos"][1] = bottom.get(x, top)
        bottom[x] = node["pos"][1] + node["size"][1] + 40
    return max(bottom.values(), default=top)


def kiln_group(kiln: list[dict]) -> dict:
    """A group framing Kiln's nodes."""
    left = min(n["pos"][0] for n in kiln) - 20
    top = min(n["pos"][1] for n in kiln) - 60
    right = max(n["pos"][0] + n["size"][0] for n in kiln) + 20
    bottom = max(n["pos"][1] + n["size"][1] for n in kiln) + 20
    return {"id": 1, "title": "Kiln", "bounding": [left, top, right - left, bottom - top], "color": "#b06634",
            "font_size": 24, "flags": {}}


def examples() -> dict[str, tuple[dict, str]]:
    """{file stem: (API workflow, note)} for every example."""
    out_ = {f"kiln_{family}_{variant}": (build(family, variant), note_text(family, variant))
            for family in FAMILIES for variant in VARIANTS}
    for kind in ("save", "load"):
        text = (f"Kiln example: SD1.5, {kind} quantized.\n\n" +
                ("Kiln › Quantize Model stores SD1.5's weights in fp8; Kiln › Save Quantized Model writes them to "
                 "models/diffusion_models/kiln/sd15_fp8.safetensors. Quantizing takes seconds; nothing is compiled."
                 if kind == "save" else
                 "Kiln › Load Quantized Model loads the fp8 file the save example wrote (quantized layers never exist "
                 "in float) and Compile UNet compiles it.\n\n" + FIRST_RUN))
        out_[f"kiln_sd15_{kind}_quantized"] = (build_quantized_files(kind), text)
    return out_


def write_all(object_info: dict, folder: Path = HERE) -> list[Path]:
    written = []
    for stem, (api, note) in examples().items():
        for path, data in ((folder / API_FOLDER / f"{stem}_api.json", api),
                           (folder / f"{stem}.json", to_ui(api, object_info, note))):
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--object-info", help="a saved /object_info JSON of a ComfyUI with Kiln installed")
    source.add_argument("--server", help="a running ComfyUI with Kiln installed, e.g. http://127.0.0.1:8188")
    args = parser.parse_args()
    if args.server:
        with urllib.request.urlopen(args.server.rstrip("/") + "/object_info", timeout=60) as response:
            object_info = json.load(response)
    else:
        object_info = json.loads(Path(args.object_info).read_text())
    for path in write_all(object_info):
        print(path.relative_to(HERE))


if __name__ == "__main__":
    main()
