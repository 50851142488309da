"""`kiln bench --shapes`: what a sequence of new shapes costs, Kiln against torch.compile.

ComfyUI users change batch size and resolution between prompts. This runs one sequence of
shapes (batch 1 -> 2 -> 4 with CFG, then two more resolutions, one of them not a multiple of
the UNet's downsampling factor) through each variant and reports, per step of the sequence:
the time to the first result at that shape, how many graphs were compiled for it, and the
steady time per step once compiled. Compile time is first result minus steady step. Models:
SD1.5's and SDXL's UNets, and Flux's transformer, which takes the sequence as its packed latent
(sides halved: one token per 2x2 latent pixels).

Targets (issue 3): after the first compile, a new batch costs no compile at all, and a new
resolution costs under a tenth of the first compile.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from .side_by_side import DTYPES, own_code, sync
from ..testing.models import MODELS

# (model batch, latent height, latent width): batch 1, 2, 4 with CFG, then new resolutions
SEQUENCES = {
    "tiny": [(2, 8, 8), (4, 8, 8), (8, 8, 8), (4, 8, 12), (4, 6, 8), (2, 8, 8)],
    "cpu": [(2, 32, 32), (4, 32, 32), (8, 32, 32), (4, 24, 40), (4, 28, 36), (2, 32, 32)],
    "full": [(2, 128, 128), (4, 128, 128), (8, 128, 128), (4, 152, 104), (4, 63, 64), (2, 128, 128)],
}


SHAPE_MODELS = ("sd15", "sdxl", "flux")  # latent height and width set apart


def sequence_for(model: str, size: str) -> list[tuple[int, int, int]]:
    """SEQUENCES[size] as `model` takes its latent: Flux packs 2x2 latent pixels into one token, so
    its side is half the UNet latent's for the same image."""
    if model == "flux":
        return [(batch, max(h // 2, 1), max(w // 2, 1)) for batch, h, w in SEQUENCES[size]]
    return SEQUENCES[size]


@dataclass
class Step:
    batch: int
    latent: list[int]
    first_s: float            # time to the first result at this shape (compile included)
    steady_ms: float          # median step once compiled
    compile_s: float          # first_s - steady step
    new_graphs: int           # graphs compiled for this shape
    max_rel_err: float


@dataclass
class Run:
    variant: str
    steps: list[Step] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def total_compile_s(self) -> float:
        return sum(s.compile_s for s in self.steps)


def _counting(backend: Callable, counter: list) -> Callable:
    def counted(gm, example_inputs):
        counter.append(1)
        return backend(gm, example_inputs)
    return counted


BASELINES = {"torch.compile dynamic=None": None, "torch.compile dynamic=True": True}
BASELINE_KEYS = {"auto": "torch.compile dynamic=None", "dynamic": "torch.compile dynamic=True"}  # for --baselines


def variant_names(modes, baselines=True) -> list[str]:
    """`baselines`: True (both torch.compile variants), False, or a list of BASELINE_KEYS."""
    if baselines is True:
        chosen = list(BASELINES)
    elif not baselines:
        chosen = []
    else:
        unknown = [key for key in baselines if key not in BASELINE_KEYS]
        if unknown:
            raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; choose from {', '.join(BASELINE_KEYS)} or none")
        chosen = [BASELINE_KEYS[key] for key in baselines]
    return chosen + [f"kiln {mode}" for mode in modes]


PIN_SUFFIX = "+pin"  # a Kiln mode with this suffix pins the sequence's first shape (static kernels for it)


def _kiln_options(name: str, first_shape):
    """CompileOptions for "kiln <mode>" or "kiln <mode>+pin" (the first shape of the sequence pinned)."""
    from .. import compiler as kiln
    from ..compiler.options.shape_policy import LATENT_FACTOR

    mode = name.removeprefix("kiln ")
    if not mode.endswith(PIN_SUFFIX):
        return kiln.CompileOptions(mode=mode)
    batch, h, w = first_shape
    pin = f"{w * LATENT_FACTOR}x{h * LATENT_FACTOR}:{batch}"
    return kiln.CompileOptions(mode=mode.removesuffix(PIN_SUFFIX), shapes={"pin": [pin]})


def _variant(name: str, module, first_shape) -> tuple[Callable, Callable[[], int]]:
    """The compiled callable for `name` and a function counting the graphs it has compiled.
    torch.compile's default backend is Inductor; counting wraps it without changing it."""
    from .. import compiler as kiln
    from ..compiler.torch_compat.dynamo import lookup_backend

    tag = name.replace(" ", "_").replace(".", "_").replace("=", "_")
    if name in BASELINES:
        graphs: list = []
        compiled = torch.compile(own_code(module, tag), dynamic=BASELINES[name],
                                 backend=_counting(lookup_backend("inductor"), graphs))
        return compiled, lambda: len(graphs)
    compiled = kiln.compile(own_code(module, tag), options=_kiln_options(name, first_shape))
    return compiled, lambda: kiln.stats(compiled).compile_count


def _measure(name: str, module, sequence, inputs, references, device: str, repeats: int, log) -> Run:
    run = Run(name)
    try:
        fn, graph_count = _variant(name, module, sequence[0])
        for (batch, h, w), (args, kwargs), reference in zip(sequence, inputs, references):
            graphs = graph_count()
            sync(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)[0]
            sync(device)
            first = time.perf_counter() - start
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn(*args, **kwargs)
                sync(device)
                samples.append(time.perf_counter() - start)
            steady = statistics.median(samples)
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            run.steps.append(Step(batch, [h, w], first, steady * 1e3, max(first - steady, 0.0),
                                  graph_count() - graphs, err))
            log(f"  {name}: batch {batch} latent {h}x{w}: first result {first:.1f}s, "
                f"{run.steps[-1].new_graphs} new graph(s)")
    except Exception as exc:  # noqa: BLE001  a failing variant is recorded, the rest still run
        run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        log(f"  {name}: FAILED {run.error}")
    return run


def _measure_in_process(names, model, size, device, dtype, repeats, log) -> list[Run]:
    spec = MODELS[model]
    module = spec.build(size, dtype=DTYPES[dtype], device=device)
    sequence = sequence_for(model, size)
    with torch.inference_mode():
        inputs = [spec.inputs(module, batch, device=device, dtype=DTYPES[dtype], latent=(h, w), seed=i)
                  for i, (batch, h, w) in enumerate(sequence)]
        references = [module(*args, **kwargs)[0].float() for args, kwargs in inputs]
        return [_measure(name, module, sequence, inputs, references, device, repeats, log) for name in names]


def _measure_isolated(name, model, size, device, dtype, repeats, log) -> Run:
    """`name` alone in a new Python process with an empty Inductor cache and temporary folder (where
    Inductor keeps its precompiled C++ headers): its first compile is cold, whatever ran before it
    (kernels or headers built by one variant would otherwise serve the next)."""
    with tempfile.TemporaryDirectory(prefix="kiln-shapes-") as tmp:
        out = os.path.join(tmp, "run.json")
        os.makedirs(os.path.join(tmp, "temp"))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"), TMPDIR=os.path.join(tmp, "temp"))
        command = [sys.executable, "-m", __name__, "--variant", name, "--model", model, "--size", size,
                   "--device", device, "--dtype", dtype, "--repeats", str(repeats), "--out", out]
        log(f"  {name}: in a new process, Inductor cache {env['TORCHINDUCTOR_CACHE_DIR']}")
        tail: list[str] = []
        with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
            for line in child.stderr:  # progress as it comes; the rest kept for an error message
                line = line.rstrip("\n")
                if line.startswith(f"  {name}: "):
                    log(line)
                elif line.strip():
                    tail = (tail + [line.strip()])[-3:]
        if child.returncode != 0 or not os.path.exists(out):
            why = f"process exited {child.returncode}: {' | '.join(tail)}"[:300]
            log(f"  {name}: FAILED {why}")
            return Run(name, error=why)
        with open(out) as f:
            data = json.load(f)
        return Run(name, [Step(**step) for step in data["steps"]], data["error"])


def run_shapes_bench(model: str = "sd15", size: str = "cpu", device: str = "cpu", dtype: str = "fp32",
                     modes=("balanced",), repeats: int = 3, baselines=True, isolate: bool = False,
                     log=print) -> dict:
    """With `isolate`, every variant runs in a process of its own with an empty Inductor cache
    (what a user's first compile costs); without, all share this process (quicker, for tests)."""
    if model not in SHAPE_MODELS:
        raise ValueError(f"kiln bench --shapes runs {', '.join(SHAPE_MODELS)}; {model!r} has no shape sequence yet")
    sequence = sequence_for(model, size)
    log(f"kiln bench --shapes: {MODELS[model].description}, {size} size, {device} {dtype}; sequence {sequence}")
    names = variant_names(modes, baselines)
    if isolate:
        runs = [_measure_isolated(name, model, size, device, dtype, repeats, log) for name in names]
    else:
        runs = _measure_in_process(names, model, size, device, dtype, repeats, log)
    return {
        "model": model, "size": size, "device": device, "dtype": dtype, "modes": list(modes),
        "sequence": [list(s) for s in sequence],
        "machine": {"torch": torch.__version__, "python": platform.python_version(),
                    "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
        "method": (f"first call per shape timed (compile included); steady = median of {repeats} calls after it; "
                   + ("each variant in its own process with an empty Inductor cache" if isolate
                      else "all variants in one process, sharing Inductor's caches")),
        "runs": [dict(asdict(r), total_compile_s=r.total_compile_s) for r in runs],
        "targets": targets(runs),
    }


def targets(runs: list[Run]) -> dict:
    """Issue 3's targets, per variant: new batches compile nothing; a new resolution < 1/10 of the first compile."""
    verdicts = {}
    for run in runs:
        if run.error or not run.steps:
            continue
        first = run.steps[0]
        seen: set = {tuple(first.latent)}
        batches_free, worst_resolution = True, 0.0
        for step in run.steps[1:]:
            if tuple(step.latent) in seen:
                batches_free &= step.new_graphs == 0
            else:
                worst_resolution = max(worst_resolution, step.compile_s / max(first.compile_s, 1e-9))
                seen.add(tuple(step.latent))
        verdicts[run.variant] = {"new_batch_compiles_nothing": batches_free,
                                 "worst_new_resolution_vs_first_compile": round(worst_resolution, 3),
                                 "new_resolution_under_a_tenth": worst_resolution < 0.1}
    return verdicts


def format_table(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        lines.append(f"{run['variant']}" + (f"  FAILED: {run['error']}" if run["error"] else ""))
        lines.append(f"  {'batch':>5} {'latent':>8} {'first s':>9} {'compile s':>10} {'graphs':>7} {'ms/step':>9} {'rel err':>9}")
        for s in run["steps"]:
            latent = f"{s['latent'][0]}x{s['latent'][1]}"
            lines.append(f"  {s['batch']:>5} {latent:>8} {s['first_s']:>9.2f} {s['compile_s']:>10.2f} {s['new_graphs']:>7} "
                         f"{s['steady_ms']:>9.1f} {s['max_rel_err']:>9.1e}")
        lines.append(f"  total compile {run['total_compile_s']:.1f}s")
    for name, verdict in result["targets"].items():
        lines.append(f"{name}: new batch compiles nothing: {'yes' if verdict['new_batch_compiles_nothing'] else 'NO'}; "
                     f"worst new resolution = {verdict['worst_new_resolution_vs_first_compile']:.2f} x first compile "
                     f"({'under' if verdict['new_resolution_under_a_tenth'] else 'NOT under'} a tenth)")
    return "\n".join(lines)


def main(args) -> int:
    from .side_by_side import default_size_and_dtype, print_and_save

    default_size_and_dtype(args)
    modes = [m for m in (args.modes if args.modes is not None else "balanced").split(",") if m]
    baselines = True if args.baselines is None else [b for b in args.baselines.split(",") if b and b != "none"]
    try:
        result = run_shapes_bench(args.model, args.size, args.device, args.dtype, modes, baselines=baselines,
                                  isolate=True, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as exc:  # a bad model or variant name: say which, no traceback
        print(f"kiln bench --shapes: {exc}", file=sys.stderr)
        return 2
    print_and_save(format_table(result), result, args.json)
    return 1 if any(r["error"] for r in result["runs"]) else 0


def _child(argv=None) -> int:
    """One variant, run by `_measure_isolated` in a fresh process; writes its Run as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    (run,) = _measure_in_process([args.variant], args.model, args.size, args.device, args.dtype, args.repeats,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
    with open(args.out, "w") as f:
        json.dump(asdict(run), f)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
