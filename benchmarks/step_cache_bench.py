"""`kiln bench --step-cache`: the step cache's speed and quality on a trained model, side by side.

Quality needs a trained model (random weights never settle), so this samples the tiny digits
denoiser (testing/digits_unet.py, trained once into the user's cache). For each step count and
seed: the uncached image, then the step cache, each method at three thresholds, each eager and on
Kiln's compile of the same model. Reported per setting: PSNR and SSIM of the final latents against
the uncached ones of the same model (min and mean over seeds), model evaluations computed (a
first_block skip runs the first block only, and counts as skipped), and wall-clock time against
the uncached run of the same model, all timed in one process. The digits' latents are their images
(8x8, the digit in every channel), so PSNR is that of the images themselves.
"""
from __future__ import annotations

import json
import math
import sys
import time

import torch

from ..testing.image_quality import psnr, ssim, summary, summary_line

SETTINGS = (("reuse", 0.03), ("reuse", 0.05), ("reuse", 0.08),          # around each method's default
            ("first_block", 0.1), ("first_block", 0.15), ("first_block", 0.2))
STEP_COUNTS = (20, 30)


def run_step_cache_bench(seeds: int = 8, step_counts=STEP_COUNTS, settings=SETTINGS, mode: str = "balanced",
                         log=print) -> dict:
    from .. import compiler as kiln
    from ..testing import digits_unet

    if not digits_unet.cache_path().exists():
        log(f"training the digits denoiser once into {digits_unet.cache_path()} (about 4 minutes on 2 cores)")
    model = digits_unet.load_or_train(progress=lambda step, loss: log(f"  training: step {step}, loss {loss:.4f}"))
    compiled = digits_unet.DigitsDenoiser(kiln.compile(model.unet, mode=mode), model.embed)
    models = {"eager": model, f"kiln {mode}": compiled}
    rows = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        digits_unet.sample(compiled, torch.tensor([0]), 2, 0)  # the compile, before any timing
        log(f"kiln bench --step-cache: the digits denoiser, {seeds} seeds, steps {list(step_counts)}, "
            f"settings {[f'{m} {t:g}' for m, t in settings]}; Kiln {mode} compiled in {time.perf_counter() - t0:.1f}s")
        for steps in step_counts:
            for name, runner in models.items():
                references, base_s = [], 0.0
                for seed in range(seeds):
                    t0 = time.perf_counter()
                    references.append(digits_unet.sample(runner, torch.tensor([seed % 10]), steps, seed))
                    base_s += time.perf_counter() - t0
                rows.append({"steps": steps, "model": name, "method": None, "threshold": None, "psnr_min": math.inf,
                             "psnr_mean": math.inf, "ssim_min": 1.0, "ssim_mean": 1.0, "computed": steps,
                             "seconds": base_s, "speedup": 1.0})
                for method, threshold in settings:
                    cached = kiln.step_cached(runner, {"method": method, "threshold": threshold})
                    quality, computed, seconds = [], 0, 0.0
                    for seed in range(seeds):
                        t0 = time.perf_counter()
                        out = digits_unet.sample(cached, torch.tensor([seed % 10]), steps, seed)
                        seconds += time.perf_counter() - t0
                        quality.append((psnr(out, references[seed]), ssim(out, references[seed])))
                        computed += cached.report().computed
                    rows.append({"steps": steps, "model": name, "method": method, "threshold": threshold,
                                 **summary(quality),
                                 "computed": computed / seeds, "seconds": seconds, "speedup": base_s / seconds,
                                 "pattern": cached.report().patterns.get("all", "")})
                for row in rows[-len(settings) - 1:]:
                    log(format_row(row))
    return {"seeds": seeds, "mode": mode, "rows": rows}


def format_row(row: dict) -> str:
    setting = "no cache" if row["threshold"] is None else f"{row['method']} {row['threshold']:g}"
    quality = "" if row["threshold"] is None else summary_line(row) + "  "
    return (f"{row['steps']:>3} steps  {row['model']:<14} {setting:<17} {quality:<45}"
            f"computed {row['computed']:5.1f}  {row['speedup']:.2f}x wall-clock  {row.get('pattern', '')}")


def main(args) -> int:
    result = run_step_cache_bench(seeds=args.seeds, log=lambda msg: print(msg, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
