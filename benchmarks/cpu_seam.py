"""`python -m kiln.benchmarks.cpu_seam`: what each CPU-only optimisation behind compiler/cpu saves.

compiler/cpu's rule: a CPU-only optimisation stays only while it saves at least
MIN_FIRST_CALL_SAVING of the CPU first call, side by side in one run (or MIN_SUITE_SAVING of the test
suite). This measures the first call as `kiln bench --cache` does for Kiln (the same child process,
benchmarks/cache_bench.py): a fresh process compiles the default model and takes its first step,
cold (an empty Kiln cache and fresh Inductor folders, as a machine's first compile) and then warm
(a fresh process from Kiln's cache, Inductor's own folders kept, as a restart). Each variant turns
one optimisation off in those processes; the variants run in rounds, in alternating order, and each
row is the median of its rounds. The share a variant adds is measured against "as shipped".
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from .side_by_side import print_and_save

# variant -> what is turned off in the child before it runs (nothing for "as shipped")
VARIANTS = {
    "as shipped": "",
    "without the convolution rule": "cpu.eager_before_capture = lambda block, device: ''",
    "probe one set after another": "cpu.lowering.PARALLEL_PROBE = False",
    "Inductor's registered backend": "cpu.inductor_compile = lambda device: None",
}
RUNS = ("kiln cold", "kiln warm")
CHILD = """
import runpy, sys
from kiln.compiler import cpu
import kiln.compiler.cpu.lowering
{toggle}
sys.argv = {argv!r}
runpy.run_module("kiln.benchmarks.cache_bench", run_name="__main__")
"""


def _child(variant: str, run: str, args, cache_dir: str, inductor_dir: str, temp_dir: str) -> dict:
    argv = ["cache_bench", "--child", run, "--model", args.model, "--size", args.size, "--device", "cpu",
            "--dtype", args.dtype, "--batch", str(args.batch), "--mode", "balanced", "--cache-dir", cache_dir]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, TMPDIR=temp_dir)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD.format(toggle=VARIANTS[variant], argv=argv)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"variant": variant, "run": run, "error": done.stderr.strip().splitlines()[-1:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(result, variant=variant, process_s=time.perf_counter() - start)


def run_cpu_seam(args, log=print) -> dict:
    rows = []
    order = list(getattr(args, "variants", None) or VARIANTS)
    for round_ in range(args.rounds):
        for variant in order if round_ % 2 == 0 else order[::-1]:
            work = tempfile.mkdtemp(prefix="kiln-cpu-seam-")
            try:
                dirs = [os.path.join(work, name) for name in ("kiln-cache", "inductor", "temp")]
                os.makedirs(dirs[2], mode=0o700)
                for run in RUNS:
                    row = dict(_child(variant, run, args, *dirs), round=round_)
                    rows.append(row)
                    log(f"round {round_ + 1}, {variant}, {run}: " + (f"first step {row['first_step_s']:.1f}s"
                                                                    if "first_step_s" in row else f"FAILED {row['error']}"))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for run in RUNS:
        medians = {variant: statistics.median(r["first_step_s"] for r in rows
                                              if r["variant"] == variant and r["run"] == run and "first_step_s" in r)
                   for variant in order}
        shipped = medians["as shipped"]
        summary[run] = {variant: {"median_s": s, "adds": s / shipped - 1} for variant, s in medians.items()}
    return {"model": args.model, "size": args.size, "dtype": args.dtype, "batch": args.batch, "rounds": args.rounds,
            "variants": order,
            "method": "first step of a fresh process (kiln bench --cache's child), cold then warm from Kiln's cache, "
                      "each variant in its own folders, variants in alternating order; medians of the rounds",
            "rows": rows, "summary": summary}


def format_table(result: dict) -> str:
    lines = [f"{'variant':<32} {'cold first step':>16} {'warm first step':>16}"]
    for variant in result["variants"]:
        cells = []
        for run in RUNS:
            entry = result["summary"][run][variant]
            share = "" if variant == "as shipped" else f" ({entry['adds']:+.0%})"
            cells.append(f"{entry['median_s']:.1f}s{share}")
        lines.append(f"{variant:<32} {cells[0]:>16} {cells[1]:>16}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--size", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", type=lambda text: [v for v in text.split(",") if v],
                        help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all; 'as shipped' is always one)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    unknown = set(args.variants or ()) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    if args.variants and "as shipped" not in args.variants:
        args.variants.insert(0, "as shipped")
    result = run_cpu_seam(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print_and_save(format_table(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
