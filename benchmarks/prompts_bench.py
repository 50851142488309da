"""`kiln bench --prompts`: a fresh process's first prompts, its regions lowered in the foreground or in
the background (`background: true`).

Every run is a fresh process (`python -m kiln.benchmarks.prompts_bench --child ...`) with an empty
Kiln cache, Inductor cache directory and temporary folder, as on a machine's first start:

  eager             the model as it is
  kiln              Kiln's compile (the first prompt waits for each region's lowering)
  kiln background   the same with `background: true` (the regions lowered in a thread while their
                    blocks run eagerly; each runs its code from its next call once it is ready)

Each child builds the model (not timed), then runs `--prompt-count` prompts of `--prompt-steps` model
calls each, a simple Euler update of the latent between calls, with `--idle` seconds of rest between
prompts (not timed: a user reading the image; the lowering thread works on). It reports each prompt's
seconds, each step's, how many regions still waited for the thread after each prompt, and a checksum
of the last prompt's result. Where the thread's Python slows the eager steps beside it (the model's
kernel launches on a GPU wait for the interpreter lock), the background's step times show it: this
is the measurement that decides whether `background` becomes the default on a device.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

RUNS = ("eager", "kiln", "kiln background")
CHILD_TIMEOUT_S = 3600  # a run that has not answered by then has hung
DT = 0.05  # the Euler step of the stand-in sampler: small, so the latent stays in the range the model saw


def _latent_of(args: tuple, kwargs: dict) -> tuple:
    """Where the latent the sampler updates is: ("arg", 0) for a UNet, ("kw", "hidden_states") for a DiT."""
    import torch

    if args and isinstance(args[0], torch.Tensor):
        return ("arg", 0)
    for key in ("hidden_states", "sample", "x"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return ("kw", key)
    raise ValueError("no latent among the model's inputs (a tensor first argument, or hidden_states/sample/x)")


def _with_latent(args: tuple, kwargs: dict, where: tuple, latent) -> tuple[tuple, dict]:
    if where[0] == "arg":
        return (latent, *args[1:]), kwargs
    return args, {**kwargs, where[1]: latent}


def child(args) -> dict:
    """One run, in this (fresh) process."""
    import torch

    from .. import compiler as kiln
    from ..testing.models import MODELS
    from .side_by_side import DTYPES, sync

    spec = MODELS[args.model]
    module = spec.build(args.size, dtype=DTYPES[args.dtype], device=args.device)
    inputs, kwargs = spec.inputs(module, args.batch, device=args.device, dtype=DTYPES[args.dtype])
    where = _latent_of(inputs, kwargs)
    start_latent = inputs[0] if where[0] == "arg" else kwargs[where[1]]
    fn = module
    if args.run != "eager":
        options = kiln.CompileOptions(mode=args.mode, background=args.run == "kiln background")
        fn = kiln.compile(module, options=options, cache_dir=args.cache_dir)
    prompts = []
    with torch.inference_mode():
        for index in range(args.prompts):
            if index:
                time.sleep(args.idle)
            latent, steps = start_latent.clone(), []
            sync(args.device)
            began = time.perf_counter()
            for _ in range(args.steps):
                step_start = time.perf_counter()
                call_args, call_kwargs = _with_latent(inputs, kwargs, where, latent)
                out = fn(*call_args, **call_kwargs)
                latent = latent - DT * (out if isinstance(out, torch.Tensor) else out[0])  # diffusers: a tuple
                sync(args.device)
                steps.append(time.perf_counter() - step_start)
            prompt = {"seconds": time.perf_counter() - began, "steps": steps}
            if args.run == "kiln background":
                prompt["regions_waiting"] = len(kiln.wait_lowered(fn, timeout=0))
            prompts.append(prompt)
    result = {"run": args.run, "prompts": prompts, "checksum": float(latent.double().abs().sum())}
    if args.run != "eager":
        stats = kiln.stats(fn)
        result["blocks"] = stats.units_line()
        result["fallback"] = stats.fallback
    return result


def _run_child(args, run: str, work: str, log) -> dict:
    own = os.path.join(work, run.replace(" ", "-"))
    temp_dir, inductor_dir = os.path.join(own, "temp"), os.path.join(own, "inductor")
    os.makedirs(temp_dir, exist_ok=True)
    command = [sys.executable, "-m", "kiln.benchmarks.prompts_bench", "--child", run, "--model", args.model,
               "--size", args.size, "--device", args.device, "--dtype", args.dtype, "--mode", args.kiln_mode,
               "--cache-dir", os.path.join(own, "kiln-cache"), "--batch", str(args.batch),
               "--prompts", str(args.prompt_count), "--steps", str(args.prompt_steps), "--idle", str(args.idle)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, TMPDIR=temp_dir)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log(f"  {run}: FAILED after {CHILD_TIMEOUT_S} s")
        return {"run": run, "error": f"no result after {CHILD_TIMEOUT_S} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        result = {"run": run, "error": " | ".join(tail)[:500]}
        log(f"  {run}: FAILED {result['error']}")
        return result
    result = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"  {run}: prompts " + ", ".join(f"{p['seconds']:.1f}s" for p in result["prompts"]))
    return result


def summarize(rows: list[dict]) -> dict:
    """Ratios within this run: each Kiln run's first prompt and all prompts against the foreground
    compile's and eager's, and after which prompt no region waited for the lowering thread."""
    by_run = {row["run"]: row for row in rows if "prompts" in row}
    if set(by_run) != set(RUNS):
        return {}

    def first(run):
        return by_run[run]["prompts"][0]["seconds"]

    def total(run):
        return sum(p["seconds"] for p in by_run[run]["prompts"])

    waiting = [p.get("regions_waiting", 0) for p in by_run["kiln background"]["prompts"]]
    settled = next((i + 1 for i, n in enumerate(waiting) if n == 0), None)
    eager_sum = by_run["eager"]["checksum"]
    return {
        "first_prompt_background_vs_kiln": first("kiln background") / first("kiln"),
        "first_prompt_background_vs_eager": first("kiln background") / first("eager"),
        "first_prompt_kiln_vs_eager": first("kiln") / first("eager"),
        "all_prompts_background_vs_kiln": total("kiln background") / total("kiln"),
        "background_regions_ready_after_prompt": settled,
        "result_difference_vs_eager": {run: abs(by_run[run]["checksum"] - eager_sum) / max(abs(eager_sum), 1e-30)
                                       for run in ("kiln", "kiln background")},
    }


def run_prompts_bench(args, log=print) -> dict:
    import torch

    from ..testing.models import MODELS

    log(f"kiln bench --prompts: {MODELS[args.model].description}, {args.size} size, {args.device} {args.dtype}, "
        f"batch {args.batch}, Kiln mode {args.kiln_mode}; {args.prompt_count} prompts of {args.prompt_steps} steps, "
        f"{args.idle:g}s idle between them; each run a fresh process, every cache empty")
    work = tempfile.mkdtemp(prefix="kiln-prompts-bench-")
    try:
        rows = [_run_child(args, run, work, log) for run in RUNS]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"model": args.model, "size": args.size, "device": args.device, "dtype": args.dtype, "batch": args.batch,
            "mode": args.kiln_mode, "prompts": args.prompt_count, "steps": args.prompt_steps, "idle_s": args.idle,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "method": "seconds per prompt (model calls with an Euler update, synchronised) in a fresh process per "
                      "run, every cache empty; model build and idle time not timed",
            "rows": rows, "summary": summarize(rows)}


def format_table(result: dict) -> str:
    count = result["prompts"]
    lines = [f"{'run':<16} " + " ".join(f"{f'prompt {i + 1}':>9}" for i in range(count))
             + "   median step, last prompt   regions waiting after each prompt"]
    for row in result["rows"]:
        if "prompts" not in row:
            lines.append(f"{row['run']:<16} FAILED: {row['error']}")
            continue
        prompts = row["prompts"]
        steps = sorted(prompts[-1]["steps"])
        waiting = " ".join(str(p["regions_waiting"]) for p in prompts if "regions_waiting" in p)
        lines.append(f"{row['run']:<16} " + " ".join(f"{p['seconds']:>8.2f}s" for p in prompts)
                     + f"   {1e3 * steps[len(steps) // 2]:>10.1f} ms" + (f"   {waiting}" if waiting else ""))
    lines += [f"{row['run']}: {row['blocks']}" + (f"; FELL BACK: {row['fallback']}" if row.get("fallback") else "")
              for row in result["rows"] if row.get("blocks")]
    s = result["summary"]
    if s:
        ready = s["background_regions_ready_after_prompt"]
        lines.append(f"first prompt: background {s['first_prompt_background_vs_kiln']:.2f}x Kiln's in the foreground, "
                     f"{s['first_prompt_background_vs_eager']:.2f}x eager's (Kiln in the foreground "
                     f"{s['first_prompt_kiln_vs_eager']:.2f}x eager's); all {count} prompts: background "
                     f"{s['all_prompts_background_vs_kiln']:.2f}x the foreground's; every region ready after "
                     + (f"prompt {ready}" if ready else f"none of the {count} prompts"))
        lines.append("last result against eager's (checksums, relative): " + ", ".join(
            f"{run} {diff:.1e}" for run, diff in s["result_difference_vs_eager"].items()))
    return "\n".join(lines)


def main(args) -> int:
    from .side_by_side import default_size_and_dtype, print_and_save

    default_size_and_dtype(args)
    args.kiln_mode = (args.modes or "balanced").split(",")[0]
    result = run_prompts_bench(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print_and_save(format_table(result), result, args.json)
    return 0 if result["summary"] else 1


if __name__ == "__main__":
    from .side_by_side import child_parser

    parser = child_parser(RUNS)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--idle", type=float, required=True)
    print(json.dumps(child(parser.parse_args())))
