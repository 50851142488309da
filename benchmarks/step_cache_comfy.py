"""The step cache beside ComfyUI core's EasyCache and a First Block Cache setting at equal speed, through
ComfyUI's own sampling, on the trained models of `kiln bench --step-cache`. Run with a ComfyUI's Python
(with diffusers importable: the models are diffusers'), its tree on COMFYUI_PATH:

    COMFYUI_PATH=~/ComfyUI ~/ComfyUI/venv/bin/python -m kiln.benchmarks.step_cache_comfy \\
        [--models digits,shapes,textures] [--seeds 8] [--steps 20,30] [--json PATH]

Each trained model runs as the diffusion model of one of ComfyUI's own model classes, behind ComfyUI's
DIFFUSION_MODEL wrappers as ComfyUI's own models are (EasyCache rides on those), with its class
embeddings as the conditioning:
- the digits and shapes UNets (testing/digits_unet.py, shapes_unet.py) in ComfyUI's SD1.5 BaseModel
  (eps, the scaled-linear schedule they were trained on), scheduler normal;
- the textures transformer (testing/textures_dit.py) in a flow BaseModel (ComfyUI's discrete flow
  sampling with the model's shift, its timestep the sigma), scheduler simple; its conditioning is
  its token state and pooled vector side by side in one cross-attention tensor, split again inside.
Per model and step count (euler, CFG 4, eager, 8 seeds; each row: PSNR and SSIM of the final latents
against the uncached run of the same seed, worst and mean, and the diffusion model's calls, counted
at the model: every skip is one call less, a first_block skip too):
- no cache (the reference); Kiln › Step Cache, each method at its default (choices.py), the default
  method first; core's EasyCache at its own default (EASYCACHE_DEFAULT);
- at equal speed: core's EasyCache (`reuse_threshold`) and Kiln's first_block (First Block Cache's
  rule: the first block's residual) at the model calls the default method computed. Their threshold
  is found by bisection (MATCH_ROUNDS halvings, in log terms); the two thresholds that bracket the
  default's calls are reported, the nearest at no more calls ("at or under") and at no fewer ("at or
  over"; one row where a threshold computes exactly the default's calls, `matched` "equal"). At or
  over computes at least what Kiln's default computes: the fair side to compare with.
Speed is model calls here (wall-clock on a CPU says little; `kiln bench` and the server bench time it).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..choices import DEFAULT_STEP_CACHE_METHOD, STEP_CACHE_THRESHOLDS
from ..testing.comfyui_path import import_comfyui
from ..testing.image_quality import psnr, ssim, summary, summary_line

MODELS = ("digits", "shapes", "textures")
STEP_COUNTS = (20, 30)
GUIDANCE = 4.0
EASYCACHE_DEFAULT = 0.2        # core's EasyCache node's default reuse_threshold
EASYCACHE_WINDOW = dict(start_percent=0.15, end_percent=0.95)   # core's defaults
MATCH_ROUNDS = 5               # bisection halvings of the threshold bracket, in log terms
MATCH_FIRST = 0.05             # the first threshold tried; doubled until it computes no more than the target
MATCH_LIMITS = {"easycache": 3.0, "first_block": 10.0}   # the largest threshold each node accepts
KILN_METHODS = tuple(sorted(STEP_CACHE_THRESHOLDS, key=lambda m: m != DEFAULT_STEP_CACHE_METHOD))


class CountedDiffusionModel(torch.nn.Module):
    """A trained network called as ComfyUI calls its diffusion model, DIFFUSION_MODEL wrappers included.
    `calls` counts the calls that ran the whole network (a first_block skip ends the call before)."""

    def __init__(self, network: torch.nn.Module, run: Callable):
        super().__init__()
        self.network = network
        self.run = run   # (network, x, timesteps, context) -> the output
        self.register_buffer("computed", torch.zeros((), dtype=torch.long), persistent=False)
        self.dtype = torch.float32  # what ComfyUI's own diffusion models say

    @property
    def calls(self) -> int:
        return int(self.computed)

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        import comfy.patcher_extension as ext

        # a copy, as the cast to a half-precision model's dtype makes on a GPU: in fp32 ComfyUI hands a flow
        # model the sampler's own latents (CONST.calculate_input returns them, and .to(float32) keeps them),
        # and core's EasyCache adds its cached change to its input in place, which then also changed the
        # latents ComfyUI computes the denoised output from (docs/measurements/2026-12-02-step-cache-by-steps.md)
        x = x.clone()
        return ext.WrapperExecutor.new_class_executor(
            self._forward, self, ext.get_all_wrappers(ext.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timesteps, context, y, control, transformer_options, **kwargs)

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        out = self.run(self.network, x, timesteps, context)
        self.computed += 1
        return out


@dataclass
class ComfyBenchModel:
    name: str
    patcher: object                       # ComfyUI's ModelPatcher
    counter: CountedDiffusionModel
    conds: Callable[[int], tuple]         # seed -> (positive, negative) conditioning
    latent: tuple                         # (channels, height, width)
    scheduler: str


def _patcher(network, run, model_type_name: str = "EPS", sampling_settings: dict | None = None):
    """A ModelPatcher of a ComfyUI BaseModel (SD1.5's config, tiny) whose diffusion model is `network`."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.SD15(dict(
        image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1], channel_mult=[1, 2],
        transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1,
        use_spatial_transformer=True, legacy=False, use_linear_in_transformer=False, context_dim=32, num_heads=8,
        num_head_channels=-1, adm_in_channels=None, use_temporal_resblock=False, use_temporal_attention=False))
    if sampling_settings is not None:
        config.sampling_settings = sampling_settings
    model = comfy.model_base.BaseModel(config, model_type=getattr(comfy.model_base.ModelType, model_type_name),
                                       device=torch.device("cpu"))
    model.diffusion_model = CountedDiffusionModel(network, run)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    return patcher, model.diffusion_model


def _unet(name: str, trained, kinds: int, null_class: int, latent: int) -> ComfyBenchModel:
    def run(unet, x, timesteps, context):
        return unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]

    def conds(seed: int):
        return ([[trained.context(torch.tensor([seed % kinds])), {}]],
                [[trained.context(torch.tensor([null_class])), {}]])

    patcher, counter = _patcher(trained.unet, run)
    return ComfyBenchModel(name, patcher, counter, conds, (4, latent, latent), "normal")


def _digits(log) -> ComfyBenchModel:
    from ..testing import digits_unet

    trained = digits_unet.load_or_train(progress=lambda step, loss: log(f"  training: step {step}, loss {loss:.4f}"))
    return _unet("digits unet", trained, 10, digits_unet.NULL_CLASS, digits_unet.LATENT)


def _shapes(log) -> ComfyBenchModel:
    from ..testing import shapes_unet

    trained = shapes_unet.load_or_train(progress=lambda step, loss: log(f"  training: step {step}, loss {loss:.4f}"))
    return _unet("shapes unet", trained, len(shapes_unet.SHAPES), shapes_unet.NULL_CLASS, shapes_unet.LATENT)


def _textures(log) -> ComfyBenchModel:
    from ..testing import textures_dit

    trained = textures_dit.load_or_train(progress=lambda step, loss: log(f"  training: step {step}, loss {loss:.4f}"))
    width = trained.token.embedding_dim

    def run(transformer, x, timesteps, context):   # context: the token state and the pooled vector side by side
        return textures_dit.velocity(transformer, x, timesteps, context[:, :1, :width], context[:, 0, width:])

    def cond(classes: torch.Tensor):
        return torch.cat([trained.token(classes), trained.pooled(classes)], -1)[:, None]

    def conds(seed: int):
        return ([[cond(torch.tensor([seed % len(textures_dit.TEXTURES)])), {}]],
                [[cond(torch.tensor([textures_dit.NULL_CLASS])), {}]])

    # ComfyUI's discrete flow sampling at the model's shift; multiplier 1: the model's timestep is the sigma
    patcher, counter = _patcher(trained.transformer, run, "FLOW", {"shift": textures_dit.SHIFT, "multiplier": 1.0})
    return ComfyBenchModel("textures dit", patcher, counter, conds, (4, textures_dit.LATENT, textures_dit.LATENT),
                           "simple")


BUILDERS = {"digits": _digits, "shapes": _shapes, "textures": _textures}


def _nodes(log):
    from ..nodes.step_cache import KilnStepCache

    try:
        from comfy_extras.nodes_easycache import EasyCacheNode
    except ImportError:
        EasyCacheNode = None
        log("this ComfyUI has no EasyCache (comfy_extras/nodes_easycache.py): Kiln's rows only")

    def kiln(model, method, threshold=-1.0):
        return KilnStepCache().apply(model, method=method, threshold=threshold)[0]

    def easycache(model, threshold):
        return EasyCacheNode.execute(model, reuse_threshold=threshold, verbose=False, **EASYCACHE_WINDOW)[0]

    return kiln, (easycache if EasyCacheNode is not None else None)


class Runs:
    """Runs one model's settings at one step count over the seeds, against the uncached references."""

    def __init__(self, bench: ComfyBenchModel, steps: int, seeds: int):
        import comfy.sample

        self.bench, self.steps, self.seeds, self.sample_fn = bench, steps, seeds, comfy.sample.sample
        self.references = None
        self.references = self.run(bench.patcher)["outs"]

    def sample(self, model, seed: int) -> torch.Tensor:
        pos, neg = self.bench.conds(seed)
        noise = torch.randn(1, *self.bench.latent, generator=torch.Generator().manual_seed(seed))
        return self.sample_fn(model, noise, self.steps, GUIDANCE, "euler", self.bench.scheduler, pos, neg,
                              torch.zeros_like(noise), disable_pbar=True, seed=seed)

    def run(self, model) -> dict:
        outs, calls = [], 0
        for seed in range(self.seeds):
            before = self.bench.counter.calls
            outs.append(self.sample(model, seed))
            calls += self.bench.counter.calls - before
        row = {"calls": calls / self.seeds, "outs": outs}
        if self.references is not None:
            row.update(summary([(psnr(out, ref), ssim(out, ref)) for out, ref in zip(outs, self.references)]))
        return row


def matched(runs: Runs, build: Callable[[float], object], target: float, limit: float) -> dict:
    """The thresholds of `build(threshold)` whose model calls bracket `target`: {"under": the row at the
    nearest threshold computing no more than `target`, "over": ... no fewer}, each with its threshold;
    either is None where no threshold up to `limit` reaches that side (an "over" of threshold 0 is the
    uncached run). Calls fall as the threshold grows; a bracket is halved MATCH_ROUNDS times."""
    tried: dict[float, dict] = {}

    def at(threshold: float) -> dict:
        if threshold not in tried:
            tried[threshold] = {"threshold": threshold, **runs.run(build(threshold))}
        return tried[threshold]

    low, high = 0.0, min(MATCH_FIRST, limit)     # low: calls >= target (threshold 0 computes every step)
    while at(high)["calls"] > target and high < limit:
        low, high = high, min(high * 2, limit)
    if at(high)["calls"] > target:
        return {"under": None, "over": at(high)}
    for _ in range(MATCH_ROUNDS):
        if at(high)["calls"] == target or low == 0.0 and high <= 1e-3:
            break
        middle = math.sqrt(low * high) if low > 0 else high / 2
        if at(middle)["calls"] > target:
            low = middle
        else:
            high = middle
    under = at(high)
    over = under if under["calls"] == target else (at(low) if low > 0 else None)
    return {"under": under, "over": over}


def run(seeds: int = 8, step_counts=STEP_COUNTS, models=MODELS, log=print) -> dict:
    import_comfyui()
    kiln, easycache = _nodes(log)
    rows = []
    for key in models:
        bench = BUILDERS[key](log)
        for steps in step_counts:
            runs = Runs(bench, steps, seeds)
            common = {"bench_model": bench.name, "steps": steps}

            def add(setting: str, row: dict, **extra):
                rows.append({**common, "setting": setting, **{k: v for k, v in row.items() if k != "outs"}, **extra})
                log(format_row(rows[-1]))

            add("no cache", {"calls": float(steps), "psnr_min": math.inf, "psnr_mean": math.inf, "ssim_min": 1.0,
                             "ssim_mean": 1.0})
            default_calls = None
            for method in KILN_METHODS:
                row = runs.run(kiln(bench.patcher, method))
                add(f"kiln {method} default", row, threshold=STEP_CACHE_THRESHOLDS[method])
                default_calls = row["calls"] if default_calls is None else default_calls
            pairs = [("first_block", lambda t: kiln(bench.patcher, "first_block", t))]
            if easycache is not None:
                add(f"easycache {EASYCACHE_DEFAULT:g} (its default)", runs.run(easycache(bench.patcher, EASYCACHE_DEFAULT)),
                    threshold=EASYCACHE_DEFAULT)
                pairs.insert(0, ("easycache", lambda t: easycache(bench.patcher, t)))
            for name, build in pairs:
                bracket = matched(runs, build, default_calls, MATCH_LIMITS[name])  # noqa: B023 (called right here)
                if bracket["over"] is bracket["under"]:
                    add(f"{name} {bracket['over']['threshold']:.4g} (at the default's calls)", bracket["over"],
                        matched="equal", matched_to=default_calls)
                    continue
                for side in ("over", "under"):
                    if bracket[side] is not None:
                        add(f"{name} {bracket[side]['threshold']:.4g} (at or {side} the default's calls)",
                            bracket[side], matched=side, matched_to=default_calls)
    return {"seeds": seeds, "rows": rows}


def format_row(row: dict) -> str:
    quality = "the reference" if row["setting"] == "no cache" else summary_line(row)
    return (f"{row['bench_model']:<13} {row['steps']:>3} steps  {row['setting']:<48} {quality:<44} "
            f"calls {row['calls']:5.2f} ({row['steps'] / row['calls']:.2f}x fewer)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", default=",".join(map(str, STEP_COUNTS)), help="step counts, comma-separated")
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of {', '.join(MODELS)}")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    models = tuple(m.strip() for m in args.models.split(","))
    if any(m not in BUILDERS for m in models):
        parser.error(f"--models {args.models!r}: use some of {', '.join(MODELS)}")
    try:
        steps = tuple(int(s) for s in args.steps.split(","))
    except ValueError:
        parser.error(f"--steps {args.steps!r}: use whole numbers separated by commas, such as 20,30")
    if args.seeds < 1 or any(s < 2 for s in steps):
        parser.error("--seeds must be at least 1 and --steps at least 2")
    logging.basicConfig(level=logging.WARNING)
    with torch.inference_mode():
        result = run(args.seeds, steps, models, log=lambda msg: print(msg, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
