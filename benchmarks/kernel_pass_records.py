"""Measure each Kiln kernel pass in place, on this GPU, and write its decision records.

    python -m kiln.benchmarks.kernel_pass_records --case sdxl-1024-cfg --out DIR   # on a CUDA machine
    python -m kiln.benchmarks.kernel_pass_records --records-from DIR/<file>.json    # here: into the shipped records

A kernel pass earns its place on a GPU only where it beats Inductor's own code for its pattern in a
real step (compiler/passes/kernel_records.py). So the case's model is compiled whole by Kiln in mode
balanced once with every kernel pass off (the step as Inductor alone makes it), then once per pass
with that pass forced on and the others off; each is timed for its wall time per step (median of
CUDA-event timings after warm-up) and the GPU's busy time per step (its kernels' own times,
torch.profiler), which the rule reads. A pass that found nothing to rewrite at the case gets no record
(said). The results file (`<date>-<gpu>-kernel-passes-<case>.json`) holds the rows and the records;
`--records-from` merges the records of such files into compiler/passes/kernel_records.json, replacing
those of the same pass, GPU and case.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from ..compiler.passes import PASSES
from ..compiler.passes.kernel_records import (RECORDS_FILE, GpuClass, KernelRecord, load_records, merged,
                                             records_text)
from .gpu_args import check_case_reps_and_cuda, listed

MEASURED_PASSES = ("fuse_geglu", "fuse_group_norm_silu")  # the kernel passes whose gate asks a record in mode balanced
KERNEL_PASSES = tuple(p.name for p in PASSES if p.kernel_op)
WITHOUT = "without kernel passes"
DEFAULT_REPS = 10


def records_from_rows(rows: list[dict], gpu: GpuClass, case: str, date: str, torch_version: str,
                      source: str) -> tuple[list[KernelRecord], list[str]]:
    """The records a run's rows make (the row WITHOUT against each pass's row), and a line for each pass
    that makes none (it failed, or rewrote nothing at the case)."""
    by_name = {row["variant"]: row for row in rows}
    base = by_name.get(WITHOUT)
    records, notes = [], []
    if base is None or base.get("error"):
        return [], [f"no record: the step without kernel passes did not run ({(base or {}).get('error')})"]
    for name, row in by_name.items():
        if name == WITHOUT:
            continue
        if row.get("error"):
            notes.append(f"{name}: no record: {row['error']}")
        elif not row.get("rewrites"):
            notes.append(f"{name}: no record: it rewrote nothing at {case}")
        else:
            records.append(KernelRecord(name, gpu.name, gpu.capability, case, row["busy_ms"], base["busy_ms"],
                                        row["ms"], base["ms"], date, torch_version, source))
    return records, notes


def measure(case_name: str, passes: tuple[str, ...], reps: int, out: Path) -> Path:
    """On a CUDA machine: the rows and records of `passes` at `case_name`, written to a results file in
    `out` (its path returned)."""
    import torch

    from .. import compiler
    from ..compiler.passes.kernel_records import gpu_class_of
    from ..compiler.torch_compat.inductor import fresh_inductor_cache
    from .gpu_suite import FULL_CASES, build_case, device_busy_ms, error_line
    from .kernel_timing import median_ms

    case = next(c for c in FULL_CASES if c.name == case_name)
    gpu = gpu_class_of("cuda")
    module, args, kwargs = build_case(case, "cuda", "full")
    rows = []
    for variant in (WITHOUT, *passes):
        switches = {name: "on" if name == variant else "off" for name in KERNEL_PASSES}
        row = {"variant": variant, "passes": switches}
        try:
            with fresh_inductor_cache(), torch.inference_mode():
                runner = compiler.compile(module, options=compiler.CompileOptions(
                    mode="balanced", compile_unit="whole", passes=switches))
                runner(*args, **kwargs)
                row["ms"] = median_ms(lambda: runner(*args, **kwargs), "cuda", warmup=3, reps=reps)
                row["busy_ms"] = device_busy_ms(lambda: runner(*args, **kwargs))
                row["rewrites"] = compiler.stats(runner).pass_counts.get(variant, 0) if variant != WITHOUT else 0
        except Exception as exc:  # noqa: BLE001  recorded; the other passes still run
            row["error"] = error_line(exc)
        finally:
            torch._dynamo.reset()
        print(f"{case_name} {variant:<24} " + (f"FAILED {row['error']}" if "error" in row else
              f"{row['ms']:8.2f} ms a step, GPU busy {row['busy_ms']:8.3f} ms, {row['rewrites']} rewrite(s)"),
              flush=True)
        rows.append(row)
    date = datetime.date.today().isoformat()
    stamp = f"{date}-{re.sub(r'[^a-z0-9]+', '-', gpu.name.lower()).strip('-')}-kernel-passes-{case_name}"
    path = out / f"{stamp}.json"
    records, notes = records_from_rows(rows, gpu, case_name, date, torch.__version__,
                                       f"benchmarks/results/{path.name}")
    for line in [r.kernel_pass + ": " + ("wins: " if r.wins else "loses: ") + r.line() for r in records] + notes:
        print(line, flush=True)
    path.write_text(json.dumps({
        "date": date, "case": case_name, "gpu": asdict(gpu), "torch": torch.__version__,
        "method": f"Kiln compile_unit whole, mode balanced, one kernel pass forced on and the others off (or all off); "
                  f"ms: median of {reps} CUDA-event timings per step after 3 warm-up steps; busy_ms: the GPU's "
                  "kernels' own times per step, torch.profiler over 3 steps",
        "rows": rows, "records": [asdict(r) for r in records], "notes": notes}, indent=2))
    print(f"wrote {path}", flush=True)
    return path


def records_in(path: Path) -> list[KernelRecord]:
    """The records of a results file this tool wrote, checked as the shipped ones are."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path.name}: no list of records (not a file of kernel_pass_records?)")
    return [KernelRecord.from_dict(r, f"{path.name} record {i}") for i, r in enumerate(data["records"])]


def merge_into(records_file: Path, results: list[Path]) -> tuple[KernelRecord, ...]:
    """Merge the records of `results` into `records_file` (written again); the merged records."""
    new = [record for path in results for record in records_in(path)]
    both = merged(load_records(records_file), new)
    records_file.write_text(records_text(both))
    return both


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="a GPU suite case, e.g. sdxl-1024-cfg (on a CUDA machine)")
    parser.add_argument("--passes", default=",".join(MEASURED_PASSES),
                        help=f"comma-separated kernel passes to measure (default {','.join(MEASURED_PASSES)})")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--records-from", type=Path, nargs="+", metavar="JSON",
                        help="merge the records of these results files into the shipped records instead")
    parser.add_argument("--records-file", type=Path, default=RECORDS_FILE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.records_from:
        if args.case:
            parser.error("--records-from merges files written before: give no --case with it")
        try:
            both = merge_into(args.records_file, args.records_from)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        print(f"{args.records_file.name}: {len(both)} record(s)")
        return 0
    passes = listed(parser, "--passes", args.passes, KERNEL_PASSES, "Kiln's kernel passes")
    check_case_reps_and_cuda(parser, args.case, args.reps, "the records measure a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    measure(args.case, passes, args.reps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
