"""The load run: 50 prompts through `kiln queue`'s client against a running ComfyUI with Kiln installed,
mixing resolutions, batch sizes, a LoRA on and off and ControlNet strengths (0 included), each one
also run without Kiln's compile nodes; every image must equal the eager one (PSNR >= 40 dB), no
prompt may fail, every Kiln compile must come in the first prompts (--settle), and recompiles (a graph
compiled again for something a guard did not allow, as opposed to a first compile of a model's graph or
block region) must stay few (--max-recompiles). Each prompt runs right before its
eager twin, so the times compare side by side. Prints the time per prompt and every compile.

    python -m kiln.testing.load_run --server http://127.0.0.1:8188 \\
        --checkpoint rand_sd15_tiny.safetensors --lora rand_lora_tiny.safetensors \\
        --controlnet my_controlnet.pth --out load-run/

The workflow is the SD1.5 ControlNet example (workflows/api/kiln_sd15_controlnet_api.json) with a LoRA
after Compile UNet. Exit status 0 when every check holds, 1 otherwise, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import struct
import sys
import zlib
from pathlib import Path

from ..client.comfy import ComfyClient, ComfyError, apply_sets
from ..client.queue import run_all
from ..client.workflow import KILN_COMPILE_NODES, check_prompt, without_nodes
from ..events import CompileEvent

WORKFLOW = Path(__file__).parents[1] / "workflows" / "api" / "kiln_sd15_controlnet_api.json"
LORA_NODE = "100"
SIZES = ((192, 192), (256, 192), (192, 256), (256, 256))
BATCHES = (1, 2)
LORA_STRENGTHS = (0.0, 0.8)
CONTROL_STRENGTHS = (0.0, 0.5, 1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="http://127.0.0.1:8188")
    parser.add_argument("--checkpoint", required=True, help="an SD1.5 checkpoint the server has")
    parser.add_argument("--lora", required=True, help="an SD1.5 LoRA the server has")
    parser.add_argument("--controlnet", required=True, help="an SD1.5 ControlNet the server has")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mode", default="fast", choices=("fast", "balanced", "max"), help="Kiln's compile mode "
                        "(fast by default: Inductor takes minutes per graph on a CPU)")
    parser.add_argument("--max-recompiles", type=int, default=4, help="fail above this many Kiln recompiles in all")
    parser.add_argument("--settle", type=int, default=2, help="fail on a Kiln compile after this many prompts")
    parser.add_argument("--out", default="load-run", help="images and results.json go here")
    parser.add_argument("--timeout", type=float, default=1800.0)


def workflow(args) -> dict:
    """The ControlNet example with a LoRA after Compile UNet, set to this server's files and mode."""
    prompt = json.loads(WORKFLOW.read_text())
    sampler = next(k for k, v in prompt.items() if v["class_type"] == "KSampler")
    prompt[LORA_NODE] = {"class_type": "LoraLoaderModelOnly", "_meta": {"title": "LoRA"},
                         "inputs": {"model": prompt[sampler]["inputs"]["model"], "lora_name": args.lora,
                                    "strength_model": 0.8}}
    prompt[sampler]["inputs"]["model"] = [LORA_NODE, 0]
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = args.checkpoint
        if node["class_type"] == "ControlNetLoader":
            inputs["control_net_name"] = args.controlnet
        if node["class_type"] == "KSampler":
            inputs["steps"] = args.steps
        if node["class_type"] in ("KilnCompileUNet", "KilnCompileControlNet"):
            inputs["mode"] = args.mode
    return prompt


def mix(prompt: dict, count: int) -> list[tuple[dict, dict]]:
    """`count` prompts cycling through every combination of size, batch, LoRA and ControlNet strength in
    a shuffled (seeded) order; each has its own seed, so ComfyUI's cache never serves one."""
    ids = {v["class_type"]: k for k, v in prompt.items()}
    latent, sampler, control = ids["EmptyLatentImage"], ids["KSampler"], ids["ControlNetApplyAdvanced"]
    combos = list(itertools.product(SIZES, BATCHES, LORA_STRENGTHS, CONTROL_STRENGTHS))
    random.Random(0).shuffle(combos)
    jobs = []
    for index, ((width, height), batch, lora, control_strength) in zip(range(count), itertools.cycle(combos)):
        settings = {f"{latent}.width": width, f"{latent}.height": height, f"{latent}.batch_size": batch,
                    f"{LORA_NODE}.strength_model": lora, f"{control}.strength": control_strength,
                    f"{sampler}.seed": index}
        jobs.append((settings, apply_sets(prompt, [f"{k}={json.dumps(v)}" for k, v in settings.items()])))
    return jobs


MAX_PNG_BYTES = 256 * 2**20        # an image file a server sent: read whole, so bounded
MAX_PNG_PIXELS = 4096 * 4096        # what is read of one (RGBA: 64 MiB of rows; the runs make 1024x1024 at most)


def read_png_file(path: Path) -> bytes:
    """The bytes of an image file a server sent, refused (ValueError) past MAX_PNG_BYTES."""
    with open(path, "rb") as file:
        data = file.read(MAX_PNG_BYTES + 1)  # read at most one byte past the bound, however the file grows
    if len(data) > MAX_PNG_BYTES:
        raise ValueError(f"{path}: more than an image file's {MAX_PNG_BYTES} bytes")
    return data


def read_png(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, channels, pixels) of an 8-bit non-interlaced PNG (what ComfyUI's SaveImage writes).
    The image is a server's answer: at most MAX_PNG_PIXELS, and its compressed rows are inflated only
    to the size its header gives (a small file unpacks into 64 MiB of rows at most)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, chunks, header = 8, [], None
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body, pos = data[pos + 8:pos + 8 + length], pos + 12 + length
        if kind == b"IHDR" and len(body) == 13:
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
    if header is None:
        raise ValueError("a PNG without its IHDR header")
    width, height, depth, color, _, _, interlace = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"a PNG of depth {depth}, color type {color}, interlace {interlace} is not read here")
    if not 0 < width * height <= MAX_PNG_PIXELS:
        raise ValueError(f"a PNG of {width}x{height} pixels: at most {MAX_PNG_PIXELS} are read")
    stride = width * channels
    expected = height * (stride + 1)
    inflate = zlib.decompressobj()
    raw = inflate.decompress(b"".join(chunks), expected + 1)
    if len(raw) != expected:
        raise ValueError(f"a {width}x{height} PNG whose rows unpack to {'more' if len(raw) > expected else 'fewer'} "
                         f"than {expected} bytes")
    pixels, previous = bytearray(), bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - corner
                near = min((abs(guess - left), 0, left), (abs(guess - up), 1, up), (abs(guess - corner), 2, corner))
                line[i] = (line[i] + near[2]) & 255
        pixels += line
        previous = line
    return width, height, channels, bytes(pixels)


def psnr(a: bytes, b: bytes) -> float:
    """PSNR in dB of two 8-bit images of the same size (inf when equal)."""
    (wa, ha, ca, pa), (wb, hb, cb, pb) = read_png(a), read_png(b)
    if (wa, ha, ca) != (wb, hb, cb):
        raise ValueError(f"images differ in size: {wa}x{ha}x{ca} vs {wb}x{hb}x{cb}")
    mse = sum((x - y) ** 2 for x, y in zip(pa, pb)) / len(pa)
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    client = ComfyClient(args.server, timeout=args.timeout)
    prompt = workflow(args)
    problems = check_prompt(prompt, client.object_info())
    if problems:
        print("load run: the server cannot run the workflow:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    print(f"== {args.prompts} prompts, each followed by its eager twin (the same prompt without Kiln's compile "
          "nodes) ==", flush=True)
    queue_args = argparse.Namespace(out=str(out / "images"), json=str(out / "prompts.json"), timeout=args.timeout)
    if run_all(client, paired(mix(prompt, args.prompts)), queue_args) != 0:
        print("load run: a prompt failed (see above)", file=sys.stderr)
        return 1
    return summarize(json.loads((out / "prompts.json").read_text()), args, out)


def paired(jobs: list[tuple[dict, dict]]) -> list[tuple[dict, dict]]:
    """Each job as queued with Kiln's nodes, then at once without them: both see the same server state, so
    their times compare side by side, and Kiln's graphs must survive the workflow switching to and fro
    (ComfyUI drops the outputs of nodes a prompt lacks, Compile UNet's among them)."""
    queued = []
    for settings, job in jobs:
        queued.append(({"run": "kiln", **settings}, job))
        queued.append(({"run": "eager", **settings}, without_nodes(job, KILN_COMPILE_NODES)))
    return queued


def summarize(records: list[dict], args: argparse.Namespace, out: Path) -> int:
    """Check and print the run from `kiln queue`'s records (kiln and eager alternating); write summary.json.
    Exit status 0 when every check holds."""
    kiln = [r for r in records if r["settings"]["run"] == "kiln"]
    eager = [r for r in records if r["settings"]["run"] == "eager"]
    failures, lowest, compiles = [], math.inf, []
    for number, (ours, reference) in enumerate(zip(kiln, eager), 1):
        settings = {k: v for k, v in ours["settings"].items() if k != "run"}
        if len(ours["images"]) != len(reference["images"]):
            failures.append(f"prompt {number}: {len(ours['images'])} image(s) vs {len(reference['images'])} eager")
        for image, twin in zip(ours["images"], reference["images"]):
            value = psnr(read_png_file(image), read_png_file(twin))
            lowest = min(lowest, value)
            if value < 40:
                failures.append(f"prompt {number} {settings}: PSNR {value:.1f} dB < 40")
        compiles += [(number, shown["node"], CompileEvent.from_message(shown)) for shown in ours.get("kiln_compiles", [])]
    seconds = {"kiln": [r["total_seconds"] for r in kiln], "eager": [r["total_seconds"] for r in eager]}
    warm = [(ours["total_seconds"], reference["total_seconds"]) for ours, reference in zip(kiln, eager)
            if not ours["kiln_compile_seconds"]]
    print(f"\n== load run: {len(kiln)} prompts, Kiln mode {args.mode}, {args.steps} steps ==")
    print(f"images equal to eager: lowest PSNR {lowest:.1f} dB over {sum(len(r['images']) for r in kiln)} "
          f"images (>= 40 required)")
    recompiles = [event for _, _, event in compiles if event.reason.startswith("recompile")]
    late = sorted({number for number, _, _ in compiles if number > args.settle})
    print(f"Kiln compiles: {len(compiles)} in all, {len(recompiles)} of them recompiles (at most "
          f"{args.max_recompiles} allowed), none after prompt {args.settle} allowed")
    for number, node, event in compiles:
        print(f"  prompt {number}: {node}: {event.line()}")
    for name, values in seconds.items():
        print(f"seconds per prompt, {name}: median {statistics.median(values):.2f}, mean {statistics.mean(values):.2f}, "
              f"max {max(values):.2f}")
    ratio = statistics.median(ours / reference for ours, reference in warm) if warm else None
    if warm:
        print(f"prompts that compiled nothing ({len(warm)}): Kiln's time / its eager twin's, median {ratio:.2f}")
    if len(recompiles) > args.max_recompiles:
        failures.append(f"{len(recompiles)} recompiles > {args.max_recompiles}")
    if late:
        failures.append(f"Kiln compiled after prompt {args.settle}: in prompt(s) {', '.join(map(str, late))}")
    summary = {"prompts": len(kiln), "mode": args.mode, "steps": args.steps,
               "lowest_psnr_db": lowest if math.isfinite(lowest) else "inf",  # JSON has no infinity
               "compiles": [{"prompt": number, "line": f"{node}: {event.line()}"} for number, node, event in compiles],
               "failures": failures,
               "seconds": {name: {"median": statistics.median(v), "mean": statistics.mean(v), "max": max(v)}
                           for name, v in seconds.items()},
               "kiln_over_eager_when_nothing_compiled": ratio}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("load run: " + ("passed" if not failures else f"{len(failures)} check(s) failed") + f"; results in {out}/")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.testing.load_run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts: give 1 or more")
    try:
        return run(args)
    except ComfyError as exc:
        print(f"load run: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
