"""`kiln warm`: compile ahead of time, through a running ComfyUI, every shape a workflow will need,
so the first prompt after a restart loads Kiln's cache at full speed. Each shape is one prompt of
`kiln queue` (queue.run_all): its line says how long it ran and what Kiln compiled for it."""
from __future__ import annotations

import argparse
import sys

from .comfy import ComfyClient, apply_sets, parse_shapes, with_shape
from .queue import run_all, seconds
from .workflow import check_api_workflow, load_workflow


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workflow", help="an API-format workflow (ComfyUI: Save (API)) with Kiln's Cache Graph and "
                        "Compile UNet nodes")
    parser.add_argument("--shapes", required=True, help="image sizes to warm, WIDTHxHEIGHT[:BATCH], comma-separated, "
                        "e.g. 1024x1024,832x1216:2")
    parser.add_argument("--server", default="http://127.0.0.1:8188")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="change an input first, e.g. --set 4.ckpt_name=sd_xl_base_1.0.safetensors")
    parser.add_argument("--steps", type=int, default=1, help="sampling steps per warm-up prompt (default 1)")
    parser.add_argument("--timeout", type=seconds, default=3600.0, help="seconds to wait for each prompt, and for "
                        "each answer of the server (default 3600)")


def uses_kiln_cache(workflow: dict) -> bool:
    """True if an API-format workflow puts Kiln's cache in a plan (Cache Graph, or Compile UNet's YAML)."""
    nodes = [node for node in workflow.values() if isinstance(node, dict)]
    return any(node.get("class_type") == "KilnCacheGraph" and node.get("inputs", {}).get("cache") != "off"
               or node.get("class_type") == "KilnCompileUNet" and "cache" in str(node.get("inputs", {}).get("advanced", ""))
               for node in nodes)


def main(args: argparse.Namespace) -> int:
    try:
        workflow = load_workflow(args.workflow)
        check_api_workflow(workflow)
        workflow = apply_sets(workflow, args.set)
        shapes = parse_shapes(args.shapes)
        jobs = [({"size": f"{width}x{height}", "batch": batch}, with_shape(workflow, width, height, batch, steps=args.steps))
                for width, height, batch in shapes]
    except ValueError as exc:
        print(f"kiln warm: {exc}", file=sys.stderr)
        return 2
    if not uses_kiln_cache(workflow):
        print("kiln warm: note: this workflow has no Kiln › Cache Graph node (nor `cache:` in Compile UNet's advanced "
              "options): the shapes are compiled in this server only, and a restart compiles them again")
    client = ComfyClient(args.server, timeout=args.timeout)
    code = run_all(client, jobs, argparse.Namespace(out=None, json=None, timeout=args.timeout),
                   "kiln warm")
    if code == 0:
        print(f"{len(jobs)} shapes warmed: their compiled graphs are in Kiln's cache (see the server log for hits and "
              "misses)")
    return code
