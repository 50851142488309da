"""Time to the first image through a real ComfyUI server, per way of compiling the UNet, each variant in a
server of its own started cold:

    python -m kiln.benchmarks.first_image_server --comfyui PATH --checkpoint FILE \\
        [--python PATH] [--steps 8] [--size 256] [--variants eager,kiln,...] [--earlier TREE] [--json PATH]

Every variant gets a fresh server (its own base directory, port, empty Inductor cache and temporary
folder: nothing one variant compiled serves another; Kiln's cache is not used), which runs the example
workflow workflows/api/kiln_sd15_compile_api.json with the variant's model node, twice (seeds 1 and 2). Per
prompt: the server's own time (execution_start to execution_success: checkpoint load, text encoding,
compiling, sampling, VAE decode), so the first prompt's is the time to the first image and the
second's what each later image costs; and the image's PSNR against the eager variant's, same seed.

Variants (VARIANTS): eager (no compile node), kiln (Compile UNet as shipped: by blocks, each region
kept compiled only where it measures faster), kiln-all-regions (every region compiled:
`measure_regions: false`), kiln-whole (`compile_unit: whole`, the whole-model compile Kiln did before
compiling by blocks), kiln-background (`background: true`: the regions lowered beside the sampling,
which runs eagerly until each region's code is ready), core (ComfyUI's TorchCompileModel, where the
server has it). `--earlier TREE` adds the kiln variant once more with Kiln from an earlier checkout (e.g. `git worktree add TREE <commit>`),
so that a change is measured against the Kiln before it in one run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ..client.comfy import ComfyClient, output_images
from ..client.workflow import KILN_COMPILE_NODES, without_nodes
from ..testing.comfy_server import REPO, comfy_server, make_base_dir
from ..testing.load_run import psnr, read_png_file
from .step_cache_server import execution_seconds

WORKFLOW = Path(__file__).parents[1] / "workflows" / "api" / "kiln_sd15_compile_api.json"
CHECKPOINT, COMPILE, LATENT, SAMPLER, SAVE = "1", "2", "5", "6", "7"
CHECKPOINT_NAME = "bench_sd15.safetensors"
SEEDS = (1, 2)


def _kiln(advanced: str) -> Callable[[dict], dict]:
    def variant(prompt: dict) -> dict:
        prompt[COMPILE]["inputs"].update(mode="balanced", advanced=advanced)
        return prompt
    return variant


def _core(prompt: dict) -> dict:
    prompt[COMPILE] = {"class_type": "TorchCompileModel", "inputs": {"model": [CHECKPOINT, 0], "backend": "inductor"}}
    return prompt


VARIANTS: dict[str, Callable[[dict], dict]] = {
    "eager": lambda prompt: without_nodes(prompt, KILN_COMPILE_NODES),
    "kiln": _kiln(""),
    "kiln-all-regions": _kiln("measure_regions: false"),
    "kiln-whole": _kiln("compile_unit: whole"),
    "kiln-background": _kiln("background: true"),
    "core": _core,
}
NEEDS = {"core": "TorchCompileModel"}


def prompt(variant: str, steps: int, size: int, seed: int) -> dict:
    out = json.loads(WORKFLOW.read_text())
    out[CHECKPOINT]["inputs"]["ckpt_name"] = CHECKPOINT_NAME
    out[LATENT]["inputs"].update(width=size, height=size, batch_size=1)
    out[SAMPLER]["inputs"].update(seed=seed, steps=steps)
    out[SAVE]["inputs"]["filename_prefix"] = f"kiln/first_image_{variant}"
    return VARIANTS[variant](out)


def run_variant(variant: str, comfyui: Path, checkpoint: Path, python: str, port: int, steps: int, size: int,
                folder: Path, log=print, pack: Path = REPO, name: str = "") -> dict:
    """One variant in a fresh server, with Kiln from this tree or the tree `pack` (the row then named
    `name`): the server's seconds per prompt and the image files."""
    variant_name = name or variant
    base = folder / variant_name
    make_base_dir(base, {"checkpoints": {CHECKPOINT_NAME: checkpoint}}, pack)
    (base / "temp").mkdir()  # the server's temporary folder, where Inductor builds its precompiled headers
    env = {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor-cache"), "KILN_CACHE_DIR": str(base / "kiln-cache"),
           "TMPDIR": str(base / "temp")}
    with comfy_server(comfyui, base, port, python, env) as (url, object_info):
        if variant in NEEDS and NEEDS[variant] not in object_info:
            log(f"  {variant}: skipped, the server has no {NEEDS[variant]}")
            return {"variant": variant, "skipped": f"no {NEEDS[variant]}"}
        client = ComfyClient(url)
        seconds, images = [], []
        for seed in SEEDS:
            record = client.wait(client.submit(prompt(variant, steps, size, seed)))
            (image,) = output_images(record)
            images.append(str(client.download(image, base)))
            seconds.append(execution_seconds(record))
            log(f"  {variant_name}: seed {seed}: {seconds[-1]:.1f} s")
    return {"variant": variant_name, "first_image_s": seconds[0], "next_image_s": seconds[1], "images": images}


def earlier_name(tree: Path) -> str:
    """The row name of the kiln variant run from an earlier Kiln tree: kiln@<its commit>, or kiln@<folder>
    where it is not a git checkout."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"kiln@{done.stdout.strip() if done.returncode == 0 else tree.name}"


def run(comfyui: Path, checkpoint: Path, python: str, variants: list[str], steps: int = 8, size: int = 256,
        port: int = 8195, folder: Path | None = None, log=print, earlier: Path | None = None) -> dict:
    folder = Path(folder or tempfile.mkdtemp(prefix="kiln-first-image-"))
    rows = [run_variant(v, comfyui, checkpoint, python, port, steps, size, folder, log) for v in variants]
    if earlier is not None:
        rows.append(run_variant("kiln", comfyui, checkpoint, python, port, steps, size, folder, log, pack=earlier,
                                name=earlier_name(earlier)))
    reference = next((r for r in rows if r["variant"] == "eager" and "images" in r), None)
    for row in rows:
        if "images" in row and reference is not None:
            row["psnr_db"] = [psnr(read_png_file(mine), read_png_file(theirs))
                              for mine, theirs in zip(row["images"], reference["images"])]
    return {"steps": steps, "size": size, "seeds": list(SEEDS), "checkpoint": checkpoint.name, "rows": rows,
            "folder": str(folder)}


def format_table(result: dict) -> str:
    rows = [r for r in result["rows"] if "first_image_s" in r]
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    lines = [f"{'variant':<18}{'first image s':>14}{'vs eager':>10}{'next image s':>14}{'PSNR vs eager':>16}"]
    for r in rows:
        ratio = f"{r['first_image_s'] / eager['first_image_s']:.2f}x" if eager else "-"
        quality = "the reference" if r is eager else (
            f"{min(r['psnr_db']):.1f} dB" if r.get("psnr_db") else "-")
        lines.append(f"{r['variant']:<18}{r['first_image_s']:>14.1f}{ratio:>10}{r['next_image_s']:>14.1f}{quality:>16}")
    lines += [f"{r['variant']}: skipped ({r['skipped']})" for r in result["rows"] if "skipped" in r]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI tree")
    parser.add_argument("--checkpoint", type=Path, required=True, help="an SD1.5 checkpoint file")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs ComfyUI (its venv's)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=256, help="image width and height in pixels")
    parser.add_argument("--port", type=int, default=8195)
    parser.add_argument("--earlier", type=Path, metavar="TREE",
                        help="a checkout of an earlier Kiln: its Compile UNet runs the kiln variant once more, last, "
                             "in a server of its own (the row kiln@<its commit>)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; use {', '.join(VARIANTS)}")
    if not (args.comfyui / "main.py").is_file():
        parser.error(f"--comfyui {args.comfyui}: no ComfyUI tree there (no main.py)")
    if not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    if args.earlier is not None and not (args.earlier / "nodes").is_dir():
        parser.error(f"--earlier {args.earlier}: no Kiln tree there (no nodes/ folder)")
    if args.steps < 1 or args.size < 64 or args.size % 8:
        parser.error("--steps must be at least 1 and --size a multiple of 8 of at least 64")
    result = run(args.comfyui, args.checkpoint, args.python, variants, args.steps, args.size, args.port,
                 log=lambda msg: print(msg, flush=True), earlier=args.earlier)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
