"""The `kiln` command (also `python -m kiln`)."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: compile diffusion models faster.")
    commands = parser.add_subparsers(dest="command", required=True)
    from .benchmarks import bench

    bench.add_arguments(commands.add_parser("bench", help="eager vs torch.compile vs Kiln on an embedded default model"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
