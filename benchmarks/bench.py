"""`kiln bench`: eager vs torch.compile vs diffusers' regional compile vs Kiln, side by side in one run.

The process first compiles a tiny function (`warm_up_compiler`: torch's compiler imports, Inductor's
CPU probe and C++ header, which a process's first compile pays once, whatever it compiles), so that
the variant timed first does not pay them for the others. Every variant is then compiled, its first
call timed as compile time in an empty Inductor cache of its own (no variant reuses kernels another
built), then all are timed in interleaved rounds so that
a drift of the machine affects them alike. Error is the max absolute difference to eager, relative
to eager's max magnitude. By default: eager, torch.compile (the whole model), diffusers'
`compile_repeated_blocks` where the model declares its repeated blocks (what a diffusers user would
pick), and Kiln balanced; `--modes` and `--units` add Kiln's other modes and compile units.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from ..choices import COMPILE_UNITS
from ..testing.models import MODELS, SIZES
from .side_by_side import (DTYPES, default_size_and_dtype, own_code, own_inputs, print_and_save, sync,
                           time_interleaved, warm_up_compiler)


@dataclass
class Row:
    variant: str
    compile_s: Optional[float] = None
    step_ms: Optional[float] = None
    speedup: Optional[float] = None     # eager time / this time
    max_rel_err: Optional[float] = None
    graphs: Optional[int] = None
    compile_cached: bool = False        # Inductor loaded the graph from its disk cache (a warm compile)
    passes: Optional[dict] = None
    blocks: str = ""                    # Kiln compiled by blocks: how many blocks, regions and graphs
    error: Optional[str] = None


def _variants(module, modes: list[str], dynamic, units=("auto",), all_regions: bool = False,
              device: str = "cpu") -> dict[str, Callable]:
    from .. import compiler as kiln

    variants = {"eager": module, "torch.compile": torch.compile(own_code(module, "torch_compile"), dynamic=dynamic)}
    if getattr(module, "_repeated_blocks", None):
        regional = copy.deepcopy(module)  # compile_repeated_blocks compiles the blocks in place, for good
        regional.compile_repeated_blocks(dynamic=dynamic)
        variants["diffusers regional"] = regional
    for mode in modes:
        for unit in units:
            options = kiln.CompileOptions(mode=mode, dynamic=dynamic, compile_unit=unit)
            name = f"kiln {mode}" + ("" if unit == "auto" else f" {unit}")
            variants[name] = kiln.compile(own_code(module, f"kiln_{mode}_{unit}"), options=options)
            if all_regions and unit != "whole":  # beside the measured choice: every region with something to fuse
                variants[f"{name} all regions"] = kiln.compile(own_code(module, f"kiln_{mode}_{unit}_all"),
                                                               options=options.replace(measure_regions=False))
            if device == "cuda":  # on a GPU the step often waits on the host: CUDA graphs take the launches off it
                variants[f"{name} + cudagraphs"] = kiln.compile(own_code(module, f"kiln_{mode}_{unit}_cudagraphs"),
                                                                options=options.replace(cuda_graphs=True))
    return variants


def _blocks_note(info) -> str:
    return f", {info.units_line()}" if info.regions else ""


def run_bench(model: str = "sd15", size: str = "cpu", device: str = "cpu", dtype: str = "fp32", batch: int = 2,
              modes=("balanced",), rounds: int = 8, steps: int = 3, dynamic=None, log=print,
              units=("auto",), all_regions: bool = False) -> dict:
    from .. import compiler as kiln
    from ..compiler.torch_compat.inductor import fresh_inductor_cache, inductor_cache_hits

    spec = MODELS[model]
    module = spec.build(size, dtype=DTYPES[dtype], device=device)
    args, kwargs = spec.inputs(module, batch, device=device, dtype=DTYPES[dtype])
    params = sum(p.numel() for p in module.parameters())
    log(f"kiln bench: {spec.description}, {size} size ({params / 1e6:.1f}M parameters), {device} {dtype}, batch {batch}")
    warm_up_s = warm_up_compiler(device)
    log(f"  warm-up compile (what a process's first compile pays once, paid here for every variant): {warm_up_s:.1f}s")
    rows: dict[str, Row] = {}
    calls: dict[str, Callable] = {}
    with torch.inference_mode():
        reference = None
        inputs = {}
        for name, fn in _variants(module, list(modes), dynamic, tuple(units), all_regions, device).items():
            row = rows[name] = Row(name)
            own_args, own_kwargs = inputs[name] = own_inputs(args, kwargs)
            try:
                sync(device)
                with fresh_inductor_cache():
                    start, hits = time.perf_counter(), inductor_cache_hits()
                    out = fn(*own_args, **own_kwargs)[0]
                    sync(device)
                    row.compile_s = time.perf_counter() - start
                row.compile_cached = inductor_cache_hits() > hits
                if reference is None:
                    reference = out.float()
                row.max_rel_err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                if name.startswith("kiln"):
                    info = kiln.stats(fn)
                    row.graphs, row.passes = info.compile_count, {k: v for k, v in info.pass_counts.items() if v}
                    row.blocks = info.units_line()
                calls[name] = fn
                log(f"  {name}: first call {row.compile_s:.1f}s{' (Inductor cache hit)' if row.compile_cached else ''}"
                    f"{_blocks_note(kiln.stats(fn)) if name.startswith('kiln') else ''}")
            except Exception as exc:  # noqa: BLE001  a failing variant is recorded, the rest still run
                row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                log(f"  {name}: FAILED {row.error}")
        times = time_interleaved(calls, inputs, device, rounds, steps)
    eager_ms = statistics.median(times["eager"]) if times.get("eager") else None
    for name, samples in times.items():
        rows[name].step_ms = statistics.median(samples)
        if eager_ms:
            rows[name].speedup = eager_ms / rows[name].step_ms
        if rows[name].compile_s is not None and name != "eager":
            rows[name].compile_s = max(rows[name].compile_s - (eager_ms or 0) / 1e3, 0.0)
    return {
        "model": model, "size": size, "device": device, "dtype": dtype, "batch": batch, "params": params,
        "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
        "method": f"median of {rounds} interleaved rounds (order reversed every other round) x {steps} steps, "
                  "after one warm-up call per variant per round; compile s: each variant's first call in an empty "
                  "Inductor cache, after one warm-up compile of a tiny function for the process",
        "warm_up_s": warm_up_s,
        "rows": [asdict(r) for r in rows.values()],
    }


def format_table(result: dict) -> str:
    head = f"{'variant':<22}{'ms/step':>10}{'vs eager':>10}{'max rel err':>13}{'compile s':>11}  passes"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"{r['variant']:<22}  FAILED: {r['error']}")
            continue
        passes = ", ".join(f"{k} x{v}" for k, v in (r["passes"] or {}).items())
        compile_s = f"{r['compile_s'] if r['variant'] != 'eager' else 0:.1f}" + ("*" if r.get("compile_cached") else "")
        lines.append(f"{r['variant']:<22}{r['step_ms']:>10.2f}{r['speedup']:>9.2f}x{r['max_rel_err']:>13.2e}"
                     f"{compile_s:>11}  {passes}")
    lines += [f"{r['variant']}: {r['blocks']}" for r in result["rows"] if r.get("blocks")]
    if any(r.get("compile_cached") for r in result["rows"]):
        lines.append("* Inductor loaded this graph from its disk cache (an identical graph was compiled before)")
    return "\n".join(lines)


def _at_least(low: int):
    def whole_number(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: at least {low}")
        return value

    return whole_number


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: seconds from 0 to 3600")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="sd15")
    parser.add_argument("--size", choices=SIZES, default=None, help="default: 'cpu' on cpu, 'full' on cuda")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on cpu, fp16 on cuda (bf16 for flux)")
    parser.add_argument("--batch", type=int, default=2, help="batch the model sees (CFG doubles a batch of 1)")
    parser.add_argument("--modes", default=None, help="comma-separated Kiln modes (default: balanced; fast, max add "
                        "rows; with --shapes: balanced; there, MODE+pin also pins the sequence's first shape)")
    parser.add_argument("--units", default="auto", help="comma-separated compile units, a Kiln row per mode and unit "
                        f"({', '.join(COMPILE_UNITS)}; default auto: blocks where the model repeats them)")
    parser.add_argument("--all-regions", action="store_true", help="also a Kiln row per mode and unit with every "
                        "region compiled (measure_regions off), beside the default that keeps a region compiled only "
                        "where it measures faster")
    parser.add_argument("--shapes", action="store_true", help="instead: the cost of a sequence of new batch sizes and "
                        "resolutions, against torch.compile dynamic=None and dynamic=True")
    parser.add_argument("--quant", action="store_true", help="instead: each quantization scheme's weight memory, time per "
                        "step (quantized eager, quantized + Kiln compile) and error, beside eager and Kiln's compile")
    parser.add_argument("--cache", action="store_true", help="instead: time to first step in fresh processes: Kiln cold, "
                        "Kiln warm from its cache, torch.compile cold and warm from Inductor's cache (mode: first of --modes)")
    parser.add_argument("--step-cache", action="store_true", help="instead: the step cache on a trained tiny model (trained "
                        "once into the user's cache, a few CPU minutes): PSNR vs uncached, model evaluations and "
                        "wall-clock per threshold, eager and compiled (needs scikit-learn)")
    parser.add_argument("--prompts", action="store_true", help="instead: a fresh process's first prompts, seconds each, "
                        "eager, Kiln and Kiln with background: true (each a fresh process, every cache empty; mode: "
                        "first of --modes)")
    parser.add_argument("--prompt-count", type=_at_least(1), default=4, help="with --prompts: prompts per run")
    parser.add_argument("--prompt-steps", type=_at_least(1), default=8, help="with --prompts: model calls per prompt")
    parser.add_argument("--idle", type=_seconds, default=5.0, help="with --prompts: seconds of rest between prompts")
    parser.add_argument("--seeds", type=int, default=8, help="with --step-cache: images per setting")
    parser.add_argument("--schemes", default="int8_weight,int8_dynamic,fp8_e4m3", help="with --quant: schemes to run")
    parser.add_argument("--policy", default="", help="with --quant: the layer policy, YAML (e.g. 'min_params: 0')")
    parser.add_argument("--baselines", default=None, help="with --shapes: torch.compile variants to run, comma-separated "
                        "from auto (dynamic=None), dynamic (dynamic=True), or none (default: both)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def main(args: argparse.Namespace) -> int:
    if args.shapes:
        from . import shapes_bench

        return shapes_bench.main(args)
    if args.quant:
        from . import quant_bench

        return quant_bench.main(args)
    if args.cache:
        from . import cache_bench

        return cache_bench.main(args)
    if args.prompts:
        from . import prompts_bench

        return prompts_bench.main(args)
    if args.step_cache:
        from . import step_cache_bench

        return step_cache_bench.main(args)
    default_size_and_dtype(args)
    result = run_bench(args.model, args.size, args.device, args.dtype, args.batch, [m for m in (args.modes or "balanced").split(",") if m],
                       args.rounds, args.steps, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                       units=[u for u in args.units.split(",") if u], all_regions=args.all_regions)
    print_and_save(format_table(result), result, args.json)
    return 1 if any(r["error"] for r in result["rows"]) else 0
