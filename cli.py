"""The `kiln` command (also `python -m kiln`). A thin client: it never imports ComfyUI."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: compile diffusion models faster.")
    commands = parser.add_subparsers(dest="command", required=True)
    from .benchmarks import bench
    from .client import queue, warm
    from .compiler.cache import commands as cache_commands

    bench.add_arguments(commands.add_parser("bench", help="eager vs torch.compile vs Kiln on an embedded default model"))
    cache_commands.add_arguments(commands.add_parser("cache", help="Kiln's compile cache: list, info, clear, export, import"))
    warm.add_arguments(commands.add_parser("warm", help="compile a workflow's shapes ahead of time through a running "
                                           "ComfyUI, into Kiln's cache"))
    queue.add_arguments(commands.add_parser("queue", help="run a workflow through a running ComfyUI, headless: "
                                            "progress, queue and run times, Kiln's compiles, images; --sweep"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    run = {"bench": bench.main, "cache": cache_commands.main, "warm": warm.main, "queue": queue.main}[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
