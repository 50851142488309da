"""The step cache through a running ComfyUI server, on the digits checkpoint.

The checkpoint (testing/digits_checkpoint.py) is an SD1.5 checkpoint whose UNet is trained on the digits,
with the test checkpoint's CLIP and VAE:

    python -m kiln.benchmarks.step_cache_server --server http://127.0.0.1:8188 \\
        --checkpoint digits_sd15_tiny.safetensors [--seeds 8] [--steps 20,30] \
        [--groups "eager,kiln compile,core compile"] [--json PATH]

The prompts are the example workflow workflows/api/kiln_sd15_step_cache_api.json at the digits' size
(64x64: 8x8 latents), euler, normal, CFG 4, "a handwritten digit N" against an empty negative, with its
model chain rebuilt per setting, in three groups:
- eager: no cache; Kiln › Step Cache, each method at its default (every setting from choices.py:
  STEP_CACHE_THRESHOLDS, STEP_CACHE_SETTINGS; the default method first); core's EasyCache at
  EASYCACHE_THRESHOLDS (its default among them);
- Kiln › Compile UNet: no cache; Kiln › Step Cache, each method at its default;
- core's TorchCompileModel: no cache; core's EasyCache at EASYCACHE_THRESHOLDS.
Each prompt's text is encoded once before any timing; each setting runs one untimed prompt first (it
pays the compiles; reported as warm-up), then one prompt per seed. Per setting: PSNR and SSIM of each image against the eager uncached image of the same seed,
and the server's own execution time of the prompts (execution_start to execution_success in each
prompt's history) against the same group's uncached run. Core's nodes are used where the server has them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from ..choices import DEFAULT_STEP_CACHE_METHOD, METHOD_THRESHOLD, STEP_CACHE_METHODS, STEP_CACHE_SETTINGS
from ..client.comfy import ComfyClient, output_images
from ..testing.digits_checkpoint import PROMPT
from ..testing.image_quality import ssim, summary, summary_line
from ..testing.load_run import psnr, read_png, read_png_file

WORKFLOW = Path(__file__).parents[1] / "workflows" / "api" / "kiln_sd15_step_cache_api.json"
CHECKPOINT, COMPILE, CACHE, POSITIVE, NEGATIVE, LATENT, SAMPLER, SAVE = "1", "2", "3", "4", "5", "6", "7", "9"
SIZE = 64                  # the digits' latents are 8x8
EASYCACHE_THRESHOLDS = (0.05, 0.2)   # 0.2: core's default
GROUPS = ("eager", "kiln compile", "core compile")


def settings(object_info: dict, mode: str) -> list[tuple[str, str, list[dict]]]:
    """(group, setting, the model chain: nodes from the checkpoint to the sampler) for each setting the
    server can run."""
    kiln_compile = {"class_type": "KilnCompileUNet", "inputs": {"mode": mode, "dynamic": "auto", "cuda_graphs": False,
                                                                "pin_shapes": "", "advanced": ""}}
    core_compile = {"class_type": "TorchCompileModel", "inputs": {"backend": "inductor"}}

    def kiln_cache(method):   # the node's defaults, the method's own threshold
        defaults = {name: default for name, (default, _) in STEP_CACHE_SETTINGS.items()}
        return {"class_type": "KilnStepCache", "inputs": {**defaults, "method": method, "threshold": METHOD_THRESHOLD}}

    def easycache(threshold):
        return {"class_type": "EasyCache", "inputs": {"reuse_threshold": threshold, "start_percent": 0.15,
                                                      "end_percent": 0.95, "verbose": False}}

    methods = sorted(STEP_CACHE_METHODS, key=lambda m: m != DEFAULT_STEP_CACHE_METHOD)
    rows = [("eager", "no cache", [])]
    rows += [("eager", f"kiln {m} default", [kiln_cache(m)]) for m in methods]
    rows += [("eager", f"easycache {t:g}", [easycache(t)]) for t in EASYCACHE_THRESHOLDS]
    rows += [("kiln compile", "no cache", [kiln_compile])]
    rows += [("kiln compile", f"kiln {m} default", [kiln_compile, kiln_cache(m)]) for m in methods]
    rows += [("core compile", "no cache", [core_compile])]
    rows += [("core compile", f"easycache {t:g}", [core_compile, easycache(t)]) for t in EASYCACHE_THRESHOLDS]
    return [row for row in rows if all(node["class_type"] in object_info for node in row[2])]


def prompt(base: dict, chain: list[dict], checkpoint: str, steps: int, seed: int) -> dict:
    """The workflow with `chain` between the checkpoint and the sampler, for digit `seed % 10`."""
    out = {key: json.loads(json.dumps(node)) for key, node in base.items() if key not in (COMPILE, CACHE)}
    source = [CHECKPOINT, 0]
    for index, node in enumerate(chain):
        key = f"chain{index}"
        out[key] = {"class_type": node["class_type"], "inputs": {**node["inputs"], "model": source}}
        source = [key, 0]
    out[SAMPLER]["inputs"].update(model=source, seed=seed, steps=steps, cfg=4.0, sampler_name="euler",
                                  scheduler="normal", denoise=1.0)
    out[CHECKPOINT]["inputs"]["ckpt_name"] = checkpoint
    out[POSITIVE]["inputs"]["text"] = PROMPT.format(seed % 10)
    out[NEGATIVE]["inputs"]["text"] = ""
    out[LATENT]["inputs"].update(width=SIZE, height=SIZE, batch_size=1)
    out[SAVE]["inputs"]["filename_prefix"] = "kiln/step_cache_bench"
    return out


def execution_seconds(record: dict) -> float:
    """The server's own time for a prompt: its execution_start to its execution_success message."""
    stamps = {kind: data.get("timestamp") for kind, data in record["status"]["messages"]}
    start, end = stamps.get("execution_start"), stamps.get("execution_success")
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        raise ValueError("the prompt's history has no execution_start and execution_success timestamps")
    return (end - start) / 1000


def _image(path: Path) -> tuple[bytes, torch.Tensor]:
    data = read_png_file(path)
    width, height, channels, pixels = read_png(data)
    tensor = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).float().reshape(height, width, channels)
    return data, tensor.permute(2, 0, 1)


def run(client: ComfyClient, checkpoint: str, seeds: int = 8, step_counts=(20, 30), mode: str = "balanced",
        folder: Path | None = None, log=print, groups=GROUPS) -> dict:
    base = json.loads(WORKFLOW.read_text())
    folder = Path(folder or tempfile.mkdtemp(prefix="kiln-step-cache-"))
    folder.mkdir(parents=True, exist_ok=True)

    def queue(chain, steps, seed):
        record = client.wait(client.submit(prompt(base, chain, checkpoint, steps, seed)))
        (image,) = output_images(record)
        return _image(client.download(image, folder)), execution_seconds(record)

    for seed in range(seeds + 1):  # untimed: the prompts' text encodings, which a server may keep for later prompts
        queue([], 1, seed)
    rows = []
    for steps in step_counts:
        references, uncached = {}, {}
        for group, setting, chain in [row for row in settings(client.object_info(), mode) if row[0] in groups]:
            _, warmup = queue(chain, steps, seeds)   # a seed the timed prompts never use
            images, seconds = [], 0.0
            for seed in range(seeds):
                image, took = queue(chain, steps, seed)
                images.append(image)
                seconds += took
            if (group, setting) == ("eager", "no cache"):
                references = dict(enumerate(images))
            if setting == "no cache":
                uncached[group] = seconds
            quality = [(psnr(png, references[s][0]), ssim(pixels, references[s][1]))
                       for s, (png, pixels) in enumerate(images)]
            row = {"steps": steps, "group": group, "setting": setting, "seconds": seconds,
                   "speedup": uncached[group] / seconds, "warmup_s": warmup, **summary(quality)}
            rows.append(row)
            log(format_row(row))
    return {"seeds": seeds, "checkpoint": checkpoint, "mode": mode, "rows": rows}


def format_row(row: dict) -> str:
    quality = "the reference" if (row["group"], row["setting"]) == ("eager", "no cache") else summary_line(row)
    return (f"{row['steps']:>3} steps  {row['group']:<13} {row['setting']:<24} {quality:<44} "
            f"{row['speedup']:.2f}x ({row['seconds']:.2f} s; warm-up {row['warmup_s']:.1f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="http://127.0.0.1:8188")
    parser.add_argument("--checkpoint", required=True, help="the digits checkpoint's name in the server's checkpoints")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", default="20,30", help="step counts, comma-separated")
    parser.add_argument("--mode", default="balanced", help="Kiln › Compile UNet's mode")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"some of {', '.join(GROUPS)} (eager is the reference)")
    parser.add_argument("--out", type=Path, default=None, help="where the images go (default: a new temporary folder)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    try:
        steps = tuple(int(s) for s in args.steps.split(","))
    except ValueError:
        parser.error(f"--steps {args.steps!r}: use whole numbers separated by commas, such as 20,30")
    if args.seeds < 1 or any(s < 1 for s in steps):
        parser.error("--seeds and --steps must be at least 1")
    groups = tuple(g.strip() for g in args.groups.split(","))
    if "eager" not in groups or any(g not in GROUPS for g in groups):
        parser.error(f"--groups {args.groups!r}: use eager and any of {', '.join(GROUPS[1:])}")
    result = run(ComfyClient(args.server), args.checkpoint, args.seeds, steps, args.mode, args.out,
                 log=lambda msg: print(msg, flush=True), groups=groups)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
