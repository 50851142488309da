"""The GPU suite: one command that turns a CUDA machine's time into committed, comparable numbers.

    python -m kiln.benchmarks.gpu_suite                 # on a CUDA machine (~8 min on an H100)
    python -m kiln.benchmarks.gpu_suite --tiny          # CPU, tiny models: checks the suite still runs

For each case (full-size architectures, random weights) and variant, in the order given (Kiln's
default first: `kiln default`, no option set), each compiled in a fresh Inductor and Triton cache,
it records time per step (median of CUDA-event timings after warm-up), the GPU's busy time per step
(its kernels' own times: well under the step means the GPU waits on the host), compile time, peak
memory, relative error vs eager (on an output of a call after the timing, a replay where the variant
records CUDA graphs, copied at once), model FLOPs per step, and the fraction of the measured matmul
ceiling; after the other
variants, eager is timed again (`eager again (timed last)`): how far the host's speed and the
profiler's hooks moved over the run, where a step waits on the host. Results go to
benchmarks/results/<date>-<gpu>.json with the raw log beside it, and its table joins those of
earlier runs in docs/gpu-results.md. A failing variant is recorded with its error and
the rest still run. Besides Kiln and a CUDA torch it needs only diffusers (a pure-Python wheel).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..choices import DEFAULT_SCHEME
from ..compiler.passes import PASSES
from .kernel_timing import median_ms
from ..testing.models import MODELS
from .side_by_side import own_inputs, sync, warm_up_compiler
from ..compiler.torch_compat.inductor import fresh_inductor_cache

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
RESULTS_PAGE = ROOT / "docs" / "gpu-results.md"  # the suite's tables, one per run, after MARK
MARK = "<!-- PERFORMANCE -->"
TABLE_START = "GPU suite, "  # each table's first line


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    batch: int
    dtype: torch.dtype
    latent: int = 0           # latent side (0: the model's default)
    channels_last: bool = False


FULL_CASES = (
    Case("sd15-512-cfg", "sd15", 2, torch.float16, 64, channels_last=True),
    Case("sdxl-1024-cfg", "sdxl", 2, torch.float16, 128, channels_last=True),
    Case("flux-1024", "flux", 1, torch.bfloat16, 64),
    Case("vae-decode-1024", "vae", 1, torch.float16, 128, channels_last=True),
)
TINY_CASES = (
    Case("sd3-tiny", "sd3", 2, torch.float32),
    Case("vae-decode-tiny", "vae", 1, torch.float32, channels_last=True),
)

# variant -> how to make it from the eager module (no commas in a name: --variants splits on them)
VARIANTS: dict[str, Callable] = {
    # Kiln as shipped, no option set: timed first (before any other compile has warmed the process)
    "kiln default": lambda m: _kiln_default(m),
    # the default with the glue between blocks eager, as before it was compiled (compiler/regional/glue.py): what
    # the glue's regions save or cost on this GPU
    "kiln default without glue": lambda m: _kiln_default(m, glue_regions="off"),
    "eager": lambda m: m,
    "torch.compile": lambda m: torch.compile(m),
    # torch's own CUDA graphs (graph trees) over the whole model: what Kiln's default must match
    "torch.compile reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead"),
    "torch.compile max-autotune": lambda m: torch.compile(m, mode="max-autotune-no-cudagraphs"),
    "kiln fast": lambda m: _kiln(m, "fast"),
    "kiln balanced": lambda m: _kiln(m, "balanced"),
    "kiln max": lambda m: _kiln(m, "max"),
    "kiln balanced + cudagraphs": lambda m: _kiln(m, "balanced", cuda_graphs=True),
    # torch's cudagraphs backend copies the weights a graph takes at every replay: what that costs beside balanced
    "kiln fast + cudagraphs": lambda m: _kiln(m, "fast", cuda_graphs=True),
    # by blocks (the default) vs the whole model as one graph: first compile and speed, with and without CUDA graphs
    "kiln balanced whole": lambda m: _kiln(m, "balanced", unit="whole"),
    "kiln balanced whole + cudagraphs": lambda m: _kiln(m, "balanced", cuda_graphs=True, unit="whole"),
    # by blocks with every region compiled, beside the default that keeps a region compiled only where it measures faster
    "kiln balanced all regions": lambda m: _kiln(m, "balanced", measure=False),
    # the same without Kiln's Triton kernels: what they add over Inductor's own fusion, in one run
    "kiln balanced without kiln kernels": lambda m: _kiln(m, "balanced", kernels=False),
    "kiln fast without kiln kernels": lambda m: _kiln(m, "fast", kernels=False),
    "kiln balanced whole without kiln kernels": lambda m: _kiln(m, "balanced", kernels=False, unit="whole"),
    # quantized (the default layer policy), then Kiln's balanced compile
    "kiln balanced + int8_weight": lambda m: _kiln(_quantized(m, "int8_weight"), "balanced"),
    "kiln balanced + int8_dynamic": lambda m: _kiln(_quantized(m, "int8_dynamic"), "balanced"),
    "kiln balanced + fp8_e4m3": lambda m: _kiln(_quantized(m, "fp8_e4m3"), "balanced"),
    # Quantize Model's defaults (its scheme and layer policy, the GPU's speed rule in it), then Kiln's default
    # compile; then each W8A8 scheme under Kiln's default (benchmarks/quant_rows.py runs these in processes of
    # their own, the original model dropped, for their peak memory)
    "kiln default + quantize defaults": lambda m: _kiln_default(_quantized(m, DEFAULT_SCHEME, defaults=True)),
    "kiln default + int8_dynamic": lambda m: _kiln_default(_quantized(m, "int8_dynamic")),
    "kiln default + fp8_e4m3": lambda m: _kiln_default(_quantized(m, "fp8_e4m3")),
}
# The quantization targets: at these cases, one of these schemes compiled by Kiln runs at least
# QUANT_SPEEDUP x faster than Kiln's own compile of the unquantized model, with at most
# QUANT_WEIGHT_FRACTION of its weight memory.
QUANT_TARGET_CASES = ("sdxl-1024-cfg", "flux-1024")
QUANT_TARGET_SCHEMES = ("kiln balanced + int8_dynamic", "kiln balanced + fp8_e4m3")
QUANT_SPEEDUP, QUANT_WEIGHT_FRACTION = 1.3, 0.55
KERNEL_PASSES = tuple(p.name for p in PASSES if p.kernel_op)


def _kiln(module, mode, cuda_graphs: bool = False, kernels: bool = True, unit: str = "auto", measure: bool = True):
    from .. import compiler

    passes = {} if kernels else {name: "off" for name in KERNEL_PASSES}
    return compiler.compile(module, options=compiler.CompileOptions(mode=mode, cuda_graphs=cuda_graphs, passes=passes,
                                                                    compile_unit=unit, measure_regions=measure))


def _kiln_default(module, **options):
    from .. import compiler

    return compiler.compile(module, options=compiler.CompileOptions(**options)) if options else compiler.compile(module)


def _quantized(module, scheme, defaults: bool = False):
    """The default layer policy; the tiny CPU-check models (under 10M parameters) have every layer under
    its size threshold, so they quantize every layer the family defaults allow (unless `defaults`: Quantize
    Model's defaults exactly)."""
    from .. import compiler

    tiny = sum(p.numel() for p in module.parameters()) < 10_000_000
    return compiler.quantize(module, scheme, policy="min_params: 0" if tiny and not defaults else None)


def weight_gb(runner) -> float:
    """Parameters and buffers of the module a variant runs (its quantized copy for a quantized variant)."""
    module = getattr(runner, "original", None) or getattr(runner, "_orig_mod", None) or runner
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2 ** 30


def quant_targets(results: list[dict]) -> list[dict]:
    """For each target case: the best quantized variant against `kiln balanced`, and whether it meets
    both targets (speed and weight memory)."""
    out = []
    for case in QUANT_TARGET_CASES:
        rows = {r["variant"]: r for r in results if r["case"] == case and not r["error"]}
        base = rows.get("kiln balanced")
        candidates = [rows[v] for v in QUANT_TARGET_SCHEMES if v in rows]
        if base is None or not candidates:
            continue
        best = min(candidates, key=lambda r: r["ms"])
        speedup, weights = base["ms"] / best["ms"], best["weight_gb"] / base["weight_gb"]
        out.append({"case": case, "variant": best["variant"], "speedup_vs_kiln": speedup, "weight_fraction": weights,
                    "met": speedup >= QUANT_SPEEDUP and weights <= QUANT_WEIGHT_FRACTION})
    return out


@dataclass
class Result:
    case: str
    variant: str
    ms: Optional[float] = None
    busy_ms: Optional[float] = None   # the GPU's kernels per step (device_busy_ms); None on a CPU
    compile_s: Optional[float] = None
    peak_mem_gb: Optional[float] = None
    rel_err: Optional[float] = None
    speedup: Optional[float] = None
    tflops: Optional[float] = None
    ceiling_fraction: Optional[float] = None
    weight_gb: Optional[float] = None
    passes: dict = field(default_factory=dict)
    error: Optional[str] = None


def matmul_ceiling_tflops(device: str, tiny: bool) -> float:
    """Measured dense matmul throughput (bf16 on a GPU, fp32 on a CPU): the roofline to compare with."""
    n = 512 if tiny else 8192
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device, warmup=3, reps=10 if tiny else 50)
    return 2 * n ** 3 / (ms / 1e3) / 1e12


KERNEL_TABLE_ROWS = 40  # the kernels a table lists, by their own GPU time


def profile_steps(fn, steps: int):
    """torch.profiler's record of the GPU over `steps` calls of `fn`, after one call outside it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof


def device_busy_ms(fn, steps: int = 3, table_to: Optional[Path] = None) -> float:
    """The GPU's busy time per call of `fn`: the sum of its kernels' own times (torch.profiler) over
    `steps` calls, per call. Far under the call's wall time, the GPU waits on the host: launches,
    Python, guards (what CUDA graphs remove). `table_to`: a file for the profile's kernel table."""
    prof = profile_steps(fn, steps)
    total_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                   for e in prof.key_averages())
    if table_to is not None:
        table_to.write_text(kernel_table(prof, "self_cuda_time_total", f"{steps} calls"))
    return total_us / 1e3 / steps


def kernel_table(prof, sort_by: str, what: str) -> str:
    """A torch.profiler profile's table of its KERNEL_TABLE_ROWS costliest entries by `sort_by`."""
    return f"torch.profiler, {what}, by {sort_by}\n" + prof.key_averages().table(sort_by=sort_by,
                                                                                 row_limit=KERNEL_TABLE_ROWS)


def table_path(folder: Path, case: str, variant: str) -> Path:
    """Where a row's kernel table goes: kernels-<case>-<variant, letters and digits>.txt."""
    return folder / f"kernels-{case}-{re.sub(r'[^a-z0-9]+', '-', variant.lower()).strip('-')}.txt"


def model_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def build_case(case: Case, device: str, size: str) -> tuple[torch.nn.Module, tuple, dict]:
    """The case's model (random weights, its dtype and layout) and the inputs of one step."""
    spec = MODELS[case.model]
    module = spec.build(size, dtype=case.dtype, device=device)
    if case.channels_last:
        module = module.to(memory_format=torch.channels_last)
    args, kwargs = spec.inputs(module, case.batch, device=device, dtype=case.dtype, latent=case.latent)
    return module, args, kwargs


def error_line(exc: BaseException) -> str:
    """A failed variant's error, one line, as the results keep it."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def run_case(case: Case, variants: list[str], device: str, size: str, reps: int, ceiling: float, log,
             on_row=lambda result: None, kernel_tables: Optional[Path] = None) -> list[Result]:
    """Every variant's row for one case, in the order given, then eager's again; `on_row` gets each row
    as it ends (the suite writes its results file then: a run cut short by a time limit keeps the rows
    it finished). Each variant compiles in a fresh Inductor and Triton cache and is called on inputs of its
    own (side_by_side.own_inputs); its error is scored on an output of a call after its timing (a replay,
    where it records CUDA graphs), copied at once; its speed against the eager row's, wherever that row
    stands. `kernel_tables`: a folder for each row's torch.profiler kernel table (table_path), written
    with its busy time on a CUDA device."""
    module, case_args, case_kwargs = build_case(case, device, size)
    results, eager_ms = [], None
    with torch.inference_mode():
        flops = model_flops(lambda: module(*case_args, **case_kwargs))
        reference = module(*case_args, **case_kwargs)[0].float().clone()  # eager's output, untimed
    for name in variants:
        result = Result(case.name, name)
        results.append(result)
        args, kwargs = own_inputs(case_args, case_kwargs)
        try:
            with fresh_inductor_cache():
                runner = VARIANTS[name](module)
                result.weight_gb = weight_gb(runner)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                with torch.inference_mode():
                    sync(device)
                    t0 = time.perf_counter()
                    runner(*args, **kwargs)
                    sync(device)
                    result.compile_s = time.perf_counter() - t0
                    result.ms = median_ms(lambda: runner(*args, **kwargs), device, warmup=3, reps=reps)
                    out = runner(*args, **kwargs)[0].float().clone()
            if name == "eager":
                eager_ms, result.speedup = result.ms, 1.0
            score(result, out, reference, flops, ceiling)
            if device == "cuda":
                result.peak_mem_gb = torch.cuda.max_memory_allocated() / 2 ** 30
                try:
                    with torch.inference_mode():
                        table = table_path(kernel_tables, case.name, name) if kernel_tables else None
                        result.busy_ms = device_busy_ms(lambda: runner(*args, **kwargs), table_to=table)
                except Exception as exc:  # noqa: BLE001  the row keeps its timings; the log says why
                    log(f"{case.name:<18} {name:<28} no busy time: {type(exc).__name__}: {exc}")
            if name.startswith("kiln"):
                from .. import compiler

                stats = compiler.stats(runner)
                result.passes = {k: v for k, v in stats.pass_counts.items() if v}
                if stats.cuda_graphs is not None:  # cuda_graphs auto on CUDA: what was replayed, and the guard
                    log(f"{case.name:<18} {name:<28} {stats.cuda_graphs.report.line()}; {stats.cuda_graphs.guard.line()}")
            busy = f"  GPU busy {result.busy_ms:7.2f} ms" if result.busy_ms is not None else ""
            log(f"{case.name:<18} {name:<28} {result.ms:9.2f} ms  err {result.rel_err:.1e}  "
                f"compile {result.compile_s:6.1f}s  {result.ceiling_fraction:6.1%} of ceiling{busy}")
        except Exception as exc:  # noqa: BLE001  recorded; the other variants still run
            result.error = error_line(exc)
            log(f"{case.name:<18} {name:<28} FAILED {result.error}\n{traceback.format_exc()}")
        finally:
            torch._dynamo.reset()  # each variant compiles from scratch
        on_row(result)
    if eager_ms is not None and len(results) > 1:
        for result in results:  # against eager, wherever its row stood (written with the next row)
            if result.ms is not None:
                result.speedup = eager_ms / result.ms
        results.append(eager_again(case, module, *own_inputs(case_args, case_kwargs), device, reps, eager_ms, reference,
                                   flops, ceiling, log))
        on_row(results[-1])
        log(f"{case.name:<18} speed against eager: " + ", ".join(f"{r.variant} {r.speedup:.2f}x" for r in results
                                                                   if r.speedup is not None))
    return results


def score(result: Result, out: torch.Tensor, reference: torch.Tensor, flops: int, ceiling: float) -> None:
    """A timed row's error against eager's output and FLOP rate (its speed against eager's: run_case)."""
    result.rel_err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
    result.tflops = flops / (result.ms / 1e3) / 1e12
    result.ceiling_fraction = result.tflops / ceiling


EAGER_AGAIN = "eager again (timed last)"


def eager_again(case: Case, module, args, kwargs, device: str, reps: int, eager_ms: float, reference, flops: int,
                ceiling: float, log) -> Result:
    """Eager timed once more after every other variant: the host's speed drifts over a run, and after
    the first CUDA profile (the busy time) torch's profiler leaves CUPTI attached to every later
    launch (unless TEARDOWN_CUPTI=1); eager's first row has neither. Its ratio to the first row says
    how far the conditions moved between the first row and the last."""
    result = Result(case.name, EAGER_AGAIN, compile_s=0.0)
    with torch.inference_mode():
        result.ms = median_ms(lambda: module(*args, **kwargs), device, warmup=3, reps=reps)
        out = module(*args, **kwargs)[0]
    score(result, out, reference, flops, ceiling)
    result.speedup = eager_ms / result.ms
    log(f"{case.name:<18} {EAGER_AGAIN:<28} {result.ms:9.2f} ms  {result.speedup:5.2f}x  (the first eager row "
        f"{eager_ms:.2f} ms: how far the host's speed and the profiler's hooks moved over the run)")
    return result


def rows_written(path: Path, data: dict, rows: list):
    """A run's `on_row`: each finished row (a dataclass) joins `rows` and `data["results"]`, and `path`
    is written again, so that a run cut short by a time limit keeps the rows it finished."""
    def write(row) -> None:
        rows.append(row)
        data["results"] = [asdict(r) for r in rows]
        path.write_text(json.dumps(data, indent=2))

    return write


def performance_table(data: dict, source: Optional[str] = None) -> str:
    """One run's table; `source`, the results file it came from, is named in its first line."""
    named = f" Results file: `{source}`." if source else ""
    lines = [f"{TABLE_START}{data['date']}, {data['machine']['device']} (torch {data['machine']['torch']}); "
             f"matmul ceiling {data['ceiling_tflops']:.0f} TFLOP/s. Speedup is vs eager in the same run.{named}", "",
             "| case | variant | ms/step | GPU busy ms | vs eager | % of ceiling | compile s | peak GB | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        if r["error"]:
            lines.append(f"| {r['case']} | {r['variant']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        mem = f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] is not None else "-"
        busy = f"{r['busy_ms']:.2f}" if r.get("busy_ms") is not None else "-"
        lines.append(f"| {r['case']} | {r['variant']} | {r['ms']:.2f} | {busy} | {r['speedup']:.2f}x | {r['ceiling_fraction']:.1%} "
                     f"| {r['compile_s']:.0f} | {mem} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def source_name(path: Path) -> str:
    """A results file as the page names it: from the repository root where it lies inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def update_results_page(data: dict | list[dict], page: Optional[Path] = None, sources: Optional[list] = None,
                        keep: bool = False) -> None:
    """Write the table of `data`, or one table per result in a list (the parts of one GPU run, each with
    its own machine line), after the PERFORMANCE marker of `page` (docs/gpu-results.md), each naming its
    results file from `sources` (same order). Without `keep` they replace every table after the marker
    (`--table-from`: the page rebuilt from the files given); with it, the tables already there stay, less
    any from the same results file, and a GPU run's own table goes last, so no run is dropped."""
    page = page or RESULTS_PAGE
    text = page.read_text()
    if MARK not in text:
        raise ValueError(f"{page} has no {MARK} marker")
    runs = data if isinstance(data, list) else [data]
    names = list(sources) if sources else [None] * len(runs)
    tables = [performance_table(d, name) for d, name in zip(runs, names)]
    head, tail = text[: text.index(MARK) + len(MARK)], text[text.index(MARK) + len(MARK):]
    if keep:
        earlier = [TABLE_START + part.strip() for part in ("\n" + tail).split("\n" + TABLE_START)[1:]]
        tables = [table for table in earlier
                  if not any(name and f"Results file: `{name}`." in table.split("\n", 1)[0] for name in names)] + tables
    page.write_text(head + "\n" + "\n\n".join(tables) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (checks the suite, measures nothing real)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--kernel-tables", action="store_true",
                        help="write each row's torch.profiler kernel table beside the results (CUDA only)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for <date>-<device>.json and .log")
    parser.add_argument("--no-table", "--no-readme", dest="no_table", action="store_true",
                        help="do not add this run's table to docs/gpu-results.md")
    parser.add_argument("--table-from", "--readme-from", dest="table_from", type=Path, nargs="+", metavar="JSON",
                        help="only rebuild docs/gpu-results.md's tables from results files (e.g. written on a CUDA "
                             "machine), a table each, in the order given")
    args = parser.parse_args(argv)
    if args.table_from:
        update_results_page([json.loads(path.read_text()) for path in args.table_from],
                            sources=[source_name(path) for path in args.table_from])
        return 0
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a CUDA machine, or pass --tiny for the CPU check")
    cases = TINY_CASES if args.tiny else FULL_CASES
    if args.cases:
        cases = tuple(c for c in cases if c.name in args.cases.split(","))
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    stamp = datetime.date.today().isoformat() + "-" + re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / f"{stamp}.log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    ceiling = matmul_ceiling_tflops(device, args.tiny)
    log(f"kiln gpu suite on {device_name}, torch {torch.__version__}; matmul ceiling {ceiling:.1f} TFLOP/s")
    warm_up_s = warm_up_compiler(device)
    log(f"warm-up compile (what a process's first compile pays once, paid here for every variant): {warm_up_s:.1f}s")
    results: list[Result] = []
    data = {"date": datetime.date.today().isoformat(), "ceiling_tflops": ceiling,
            "machine": {"device": device_name, "torch": torch.__version__,
                        "triton": _version("triton"), "diffusers": _version("diffusers")},
            "method": "median of CUDA-event timings per step after 3 warm-up calls; compile = first call, after "
                      "one warm-up compile of a tiny function for the process; torch._dynamo.reset() between variants",
            "warm_up_s": warm_up_s,
            "results": []}

    write = rows_written(args.out / f"{stamp}.json", data, results)
    for case in cases:
        run_case(case, variants, device, "tiny" if args.tiny else "full", args.reps or (3 if args.tiny else 20), ceiling,
                 log, on_row=write, kernel_tables=args.out if args.kernel_tables else None)
    data["quant_targets"] = quant_targets(data["results"])
    for target in data["quant_targets"]:
        log(f"quantization target at {target['case']}: {target['variant']} {target['speedup_vs_kiln']:.2f}x vs kiln "
            f"balanced (target {QUANT_SPEEDUP}x), weights {target['weight_fraction']:.0%} (target <= "
            f"{QUANT_WEIGHT_FRACTION:.0%}): {'met' if target['met'] else 'NOT met'}")
    (args.out / f"{stamp}.json").write_text(json.dumps(data, indent=2))
    log(f"wrote {args.out / (stamp + '.json')}")
    if not args.no_table and not args.tiny:
        update_results_page(data, sources=[source_name(args.out / f"{stamp}.json")], keep=True)
    return 0


def _version(name: str) -> Optional[str]:
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
