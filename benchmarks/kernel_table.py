"""Where a step's GPU time goes, kernel by kernel: Kiln against torch.compile on one model case.

    python -m kiln.benchmarks.kernel_table --case sdxl-1024-cfg --out DIR    # on a CUDA machine

For each variant (default: `kiln balanced whole` and `torch.compile`, each compiled in a fresh Inductor
and Triton cache), after warm-up: the wall time per step (median of CUDA-event timings over --reps
steps) and a torch.profiler table of the GPU's kernels over PROFILED_STEPS steps: each kernel's own
time and calls per step, and the kernels grouped by class (KERNEL_CLASSES: matmul, convolution,
attention, Kiln's Triton kernels, Inductor's generated Triton, norms, elementwise, copies and layout,
other). Per variant a JSON file (`<date>-<gpu>-kernels-<case>-<variant>.json`) and one markdown table
of the classes side by side (`...-kernels-<case>.md`): which class of kernel costs Kiln more than
torch.compile, and by how much. A failing variant is recorded with its error; the rest still run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Optional

from .gpu_args import check_case_reps_and_cuda, listed

PROFILED_STEPS = 3
DEFAULT_VARIANTS = ("kiln balanced whole", "torch.compile")
DEFAULT_REPS = 10
TOP_KERNELS = 40  # kernels kept per variant, by time
# (class, pattern on the kernel's name), the first that matches wins
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|attn|sdpa|cudnn_generated_fort_native_sdpa"),
    ("inductor triton", r"^triton_"),
    # Kiln's Triton kernels (kernels/*.py), by their function names
    ("kiln kernel", r"^_(geglu_kernel|group_stats_kernel|group_apply_kernel|layer_norm_modulate_kernel)"),
    ("convolution", r"conv|implicit_gemm|dgrad|wgrad|fprop|winograd"),
    ("matmul", r"gemm|cutlass|xmma|ampere_|hopper_|nvjet|cublas|matmul|splitk|_mm_"),
    ("norm", r"norm"),
    ("copy and layout", r"copy|memcpy|memset|transpose|permute|contiguous|cat|nchw|nhwc|convert"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|silu|gelu|add|mul|softmax"),
)
OTHER = "other"


def kernel_class(name: str) -> str:
    """The class of a GPU kernel by its name (KERNEL_CLASSES), OTHER when none matches."""
    lowered = name.lower()
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, lowered):
            return label
    return OTHER


def by_class(kernels: list[dict]) -> dict[str, dict]:
    """{class: {"ms": per step, "calls": per step}} over `kernels` ({"name", "ms", "calls"} per step)."""
    classes: dict[str, dict] = {}
    for kernel in kernels:
        entry = classes.setdefault(kernel_class(kernel["name"]), {"ms": 0.0, "calls": 0.0})
        entry["ms"] += kernel["ms"]
        entry["calls"] += kernel["calls"]
    return dict(sorted(classes.items(), key=lambda item: -item[1]["ms"]))


def classes_table(runs: dict[str, dict]) -> str:
    """A markdown table of the kernel classes, one column pair (ms, calls a step) per variant, the first
    variant's difference to each other variant last."""
    names = list(runs)
    labels = sorted({label for run in runs.values() for label in run.get("classes", {})},
                    key=lambda label: -max(run.get("classes", {}).get(label, {}).get("ms", 0.0) for run in runs.values()))
    head = "| kernel class | " + " | ".join(f"{n} ms | {n} calls" for n in names)
    head += "".join(f" | {names[0]} - {n} ms" for n in names[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names) + len(names) - 1)]

    def cell(run, label, key):
        value = run.get("classes", {}).get(label, {}).get(key)
        return "-" if value is None else (f"{value:.3f}" if key == "ms" else f"{value:.0f}")

    for label in labels:
        cells = [f"{cell(runs[n], label, 'ms')} | {cell(runs[n], label, 'calls')}" for n in names]
        diffs = [runs[names[0]].get("classes", {}).get(label, {}).get("ms", 0.0)
                 - runs[n].get("classes", {}).get(label, {}).get("ms", 0.0) for n in names[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + "".join(f" | {d:+.3f}" for d in diffs) + " |")

    def total(run, key, form):
        return form.format(run[key]) if run.get(key) is not None else "-"

    cells = [f"{total(runs[n], 'busy_ms', '{:.3f}')} | {total(runs[n], 'launches', '{:.0f}')}" for n in names]
    diffs = [f"{runs[names[0]]['busy_ms'] - runs[n]['busy_ms']:+.3f}"
             if runs[names[0]].get("busy_ms") is not None and runs[n].get("busy_ms") is not None else "-"
             for n in names[1:]]
    lines.append("| **GPU busy, all kernels** | " + " | ".join(cells) + "".join(f" | {d}" for d in diffs) + " |")
    return "\n".join(lines)


def profiled_kernels(fn, steps: int = PROFILED_STEPS) -> list[dict]:
    """The GPU kernels of `steps` calls of `fn`, each {"name", "ms", "calls"} per step, by time."""
    from .gpu_suite import profile_steps

    prof = profile_steps(fn, steps)
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us:
            kernels.append({"name": event.key[:300], "ms": us / 1e3 / steps, "calls": event.count / steps})
    return sorted(kernels, key=lambda k: -k["ms"])


def run(case_name: str, variants: tuple[str, ...], reps: int, out: Path) -> dict[str, dict]:
    """On a CUDA machine: each variant's profile, written to `out`; the runs by variant."""
    import torch

    from ..compiler.torch_compat.inductor import fresh_inductor_cache
    from .gpu_suite import FULL_CASES, VARIANTS, build_case, error_line
    from .kernel_timing import median_ms

    case = next(c for c in FULL_CASES if c.name == case_name)
    module, args, kwargs = build_case(case, "cuda", "full")
    gpu = torch.cuda.get_device_name()
    stamp = f"{datetime.date.today().isoformat()}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-kernels-{case_name}"
    runs: dict[str, dict] = {}
    for variant in variants:
        entry: dict = {"case": case_name, "variant": variant, "gpu": gpu, "torch": torch.__version__}
        try:
            with fresh_inductor_cache(), torch.inference_mode():
                runner = VARIANTS[variant](module)
                runner(*args, **kwargs)
                entry["ms"] = median_ms(lambda: runner(*args, **kwargs), "cuda", warmup=3, reps=reps)
                kernels = profiled_kernels(lambda: runner(*args, **kwargs))
            entry["busy_ms"] = sum(k["ms"] for k in kernels)
            entry["launches"] = sum(k["calls"] for k in kernels)
            entry["classes"] = by_class(kernels)
            entry["kernels"] = kernels[:TOP_KERNELS]
            print(f"{case_name} {variant:<24} {entry['ms']:8.2f} ms a step, GPU busy {entry['busy_ms']:8.3f} ms, "
                  f"{entry['launches']:.0f} kernels a step", flush=True)
            for label, c in entry["classes"].items():
                print(f"    {label:<18} {c['ms']:8.3f} ms  {c['calls']:6.0f} calls", flush=True)
        except Exception as exc:  # noqa: BLE001  recorded; the other variants still run
            entry["error"] = error_line(exc)
            print(f"{case_name} {variant:<24} FAILED {entry['error']}", flush=True)
        finally:
            torch._dynamo.reset()
        slug = re.sub(r"[^a-z0-9]+", "-", variant.lower()).strip("-")
        (out / f"{stamp}-{slug}.json").write_text(json.dumps(entry, indent=2))
        runs[variant] = entry
    table = classes_table(runs)
    (out / f"{stamp}.md").write_text(f"GPU kernels per step by class, {case_name} on {gpu} (torch {torch.__version__}), "
                                     f"{PROFILED_STEPS} profiled steps after warm-up\n\n{table}\n")
    print(table, flush=True)
    return runs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="a GPU suite case, e.g. sdxl-1024-cfg")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated GPU suite variants")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    from .gpu_suite import VARIANTS

    variants = listed(parser, "--variants", args.variants, VARIANTS, "the GPU suite's variants")
    check_case_reps_and_cuda(parser, args.case, args.reps, "the kernel table profiles a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.case, variants, args.reps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
