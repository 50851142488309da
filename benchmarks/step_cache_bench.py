"""`kiln bench --step-cache`: the step cache's speed and quality on trained models, side by side.

Quality needs a trained model (random weights never settle), so this samples three tiny ones Kiln
trains once into the user's cache, of different data and layouts (BENCH_MODELS): the digits
denoiser (testing/digits_unet.py, the SD1.5 UNet layout on scikit-learn's digits, DDIM), the
shapes denoiser (testing/shapes_unet.py, the same layout on drawn shapes, DDIM) and the textures
transformer (testing/textures_dit.py, Flux's layout on textures, flow matching, Euler on shifted
sigmas). The defaults were chosen on the digits denoiser (`chosen_on`); the other two report how
they hold on models nobody tuned them to.

For each model, step count and seed: the uncached image, then each setting, eagerly (every
setting) and on Kiln's compile of the same model (the default only: the skips and images are the
eager ones, tests/step_cache/test_step_cache_quality.py; what compile adds is the time). Reported
per setting: PSNR and SSIM of the final latents against the uncached ones of the same model and
seed (worst and mean over seeds), model evaluations computed (a first_block skip runs the first
block only, and counts as skipped), the estimated error spent, and wall-clock time against the
uncached run of the same runner (eager against eager, compiled against compile alone), all timed
in one process, each seed's runs back to back. The cached models are given the run's timesteps
(recorded from one uncached run, untimed), so their start_percent and end_percent count steps, as
ComfyUI's node does.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..choices import DEFAULT_STEP_CACHE_METHOD, STEP_CACHE_THRESHOLDS
from ..testing.image_quality import psnr, ssim, summary, summary_line

# each method at its default threshold, the default first
SETTINGS = tuple((method, STEP_CACHE_THRESHOLDS[method]) for method in
                 sorted(STEP_CACHE_THRESHOLDS, key=lambda m: m != DEFAULT_STEP_CACHE_METHOD))
STEP_COUNTS = (20, 30)


@dataclass(frozen=True)
class BenchModel:
    name: str
    load: Callable[[Callable], torch.nn.Module]                     # (progress) -> the trained model
    compiled: Callable[[torch.nn.Module, str], torch.nn.Module]     # (trained, mode) -> it on Kiln's compile
    sample: Callable                                                # (model, classes, steps, seed) -> latents
    num_train_timesteps: float                                      # what its timesteps are divided by
    chosen_on: bool                                                 # were the defaults chosen on it


def _digits() -> BenchModel:
    from .. import compiler as kiln
    from ..testing import digits_unet

    return BenchModel("digits unet", lambda progress: digits_unet.load_or_train(progress=progress),
                      lambda m, mode: digits_unet.DigitsDenoiser(kiln.compile(m.unet, mode=mode), m.embed),
                      digits_unet.sample, 1000, chosen_on=True)


def _shapes() -> BenchModel:
    from .. import compiler as kiln
    from ..testing import shapes_unet

    return BenchModel("shapes unet", lambda progress: shapes_unet.load_or_train(progress=progress),
                      lambda m, mode: shapes_unet.denoiser(kiln.compile(m.unet, mode=mode), m.embed),
                      shapes_unet.sample, 1000, chosen_on=False)


def _textures() -> BenchModel:
    from .. import compiler as kiln
    from ..testing import textures_dit

    return BenchModel("textures dit", lambda progress: textures_dit.load_or_train(progress=progress),
                      lambda m, mode: textures_dit.TexturesDenoiser(kiln.compile(m.transformer, mode=mode), m.token,
                                                                    m.pooled),
                      textures_dit.sample, 1, chosen_on=False)


BENCH_MODELS = {"digits": _digits, "shapes": _shapes, "textures": _textures}


def run_step_cache_bench(seeds: int = 8, step_counts=STEP_COUNTS, settings=SETTINGS, mode: str = "balanced",
                         models=tuple(BENCH_MODELS), log=print) -> dict:
    from .. import compiler as kiln

    rows = []
    for key in models:
        bench = BENCH_MODELS[key]()
        model = bench.load(lambda step, loss: log(f"  training the {bench.name}: step {step}, loss {loss:.4f}"))
        compiled = bench.compiled(model, mode)
        runners = {"eager": (model, settings), f"kiln {mode}": (compiled, settings[:1])}
        with torch.inference_mode():
            t0 = time.perf_counter()
            bench.sample(compiled, torch.tensor([0]), 2, 0)  # the compile, before any timing
            log(f"kiln bench --step-cache: the {bench.name} ({'defaults chosen on it' if bench.chosen_on else 'defaults not chosen on it'}), "
                f"{seeds} seeds, steps {list(step_counts)}, settings {[f'{m} {t:g}' for m, t in settings]}; "
                f"Kiln {mode} compiled in {time.perf_counter() - t0:.1f}s")
            for steps in step_counts:
                for runner_name, (runner, runner_settings) in runners.items():
                    rows += _rows(kiln, bench, runner, runner_name, runner_settings, steps, seeds, log)
    return {"seeds": seeds, "mode": mode, "rows": rows}


def _rows(kiln, bench: BenchModel, runner, runner_name: str, settings, steps: int, seeds: int, log) -> list[dict]:
    """One row per setting and the uncached one; each seed's runs back to back (uncached first), so a
    machine whose load drifts times every setting under the same load."""
    cached = [kiln.step_cached(runner, {"method": method, "threshold": threshold},
                               num_train_timesteps=bench.num_train_timesteps) for method, threshold in settings]
    seconds = [0.0] * (1 + len(settings))
    quality, computed, spent = [[] for _ in settings], [0] * len(settings), [0.0] * len(settings)
    for seed in range(seeds):
        t0 = time.perf_counter()
        reference = bench.sample(runner, torch.tensor([seed]), steps, seed)
        seconds[0] += time.perf_counter() - t0
        if seed == 0:  # the run's timesteps, so the cache counts progress in steps as ComfyUI's node does
            for model in cached:
                model.set_timesteps(sampled_timesteps(bench, runner, steps))
        for i, model in enumerate(cached):
            t0 = time.perf_counter()
            out = bench.sample(model, torch.tensor([seed]), steps, seed)
            seconds[1 + i] += time.perf_counter() - t0
            quality[i].append((psnr(out, reference), ssim(out, reference)))
            computed[i] += model.report().computed
            spent[i] = max(spent[i], model.report().error_spent)
    common = {"bench_model": bench.name, "chosen_on": bench.chosen_on, "steps": steps, "model": runner_name}
    rows = [{**common, "method": None, "threshold": None, "psnr_min": math.inf, "psnr_mean": math.inf,
             "ssim_min": 1.0, "ssim_mean": 1.0, "computed": steps, "error_spent": 0.0, "seconds": seconds[0],
             "speedup": 1.0}]
    for i, (method, threshold) in enumerate(settings):
        rows.append({**common, "method": method, "threshold": threshold, **summary(quality[i]),
                     "computed": computed[i] / seeds, "error_spent": spent[i], "seconds": seconds[1 + i],
                     "speedup": seconds[0] / seconds[1 + i], "pattern": cached[i].report().patterns.get("all", "")})
    for row in rows:
        log(format_row(row))
    return rows


def sampled_timesteps(bench: BenchModel, runner, steps: int) -> list[float]:
    """The timesteps `bench.sample` calls `runner` with in a run of `steps` (one run, recorded)."""
    seen: list[float] = []

    def recording(x, t, *args):
        seen.append(float(t.max()))
        return runner(x, t, *args)

    bench.sample(recording, torch.tensor([0]), steps, 0)
    return seen


def format_row(row: dict) -> str:
    setting = "no cache" if row["threshold"] is None else f"{row['method']} {row['threshold']:g}"
    quality = "" if row["threshold"] is None else summary_line(row) + "  "
    return (f"{row.get('bench_model', ''):<13} {row['steps']:>3} steps  {row['model']:<14} {setting:<17} {quality:<45}"
            f"computed {row['computed']:5.1f} ({row['steps'] / row['computed']:.2f}x fewer)  "
            f"error spent {row.get('error_spent', 0.0):.3f}  {row['speedup']:.2f}x wall-clock  {row.get('pattern', '')}")


def main(args) -> int:
    mode = (getattr(args, "modes", None) or "balanced").split(",")[0]
    result = run_step_cache_bench(seeds=args.seeds, mode=mode, log=lambda msg: print(msg, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
