"""The step cache beside ComfyUI core's EasyCache, through ComfyUI's own sampling, on the trained digits
denoiser (testing/digits_unet.py), eager and compiled. Run with a ComfyUI's Python, its tree on COMFYUI_PATH:

    COMFYUI_PATH=~/ComfyUI ~/ComfyUI/venv/bin/python -m kiln.benchmarks.step_cache_comfy [--json PATH]

The trained UNet (diffusers) stands in for an SD1.5 checkpoint's: ComfyUI's SD1.5 BaseModel (eps, the
same scaled-linear schedule it was trained on) runs it as its diffusion model, behind ComfyUI's
DIFFUSION_MODEL wrappers as ComfyUI's own UNet is (EasyCache rides on those), with the class
embeddings as the conditioning. Three groups, side by side in one process, at 20 and 30 steps
(euler, normal, CFG 4), 8 seeds each:
- eager: no cache; Kiln's step cache, each method at three thresholds; core's EasyCache at three;
- Kiln › Compile UNet (balanced): no cache; Kiln's step cache, each method at its default;
- core's compile node (TorchCompileModel, inductor): no cache; core's EasyCache at 0.05 and its default.
Per setting: PSNR and SSIM of the final latents against the eager uncached run of the same seed, the
diffusion model's calls (counted at the model: every skipped call is one less), and wall-clock against
the same group's uncached run, timed after one untimed run of the same setting (which pays any
compile; its time is reported as warm-up).
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from ..testing.comfyui_path import import_comfyui
from ..testing.image_quality import psnr, ssim, summary, summary_line

KILN_THRESHOLDS = {"reuse": (0.03, 0.05, 0.08), "first_block": (0.1, 0.15, 0.2)}
EASYCACHE_THRESHOLDS = (0.05, 0.1, 0.2)   # core's default is 0.2
STEP_COUNTS = (20, 30)


class DigitsDiffusionModel(torch.nn.Module):
    """The trained UNet called as ComfyUI calls its diffusion model, DIFFUSION_MODEL wrappers included.
    `calls` counts the calls that ran the whole UNet (a first_block skip ends the call before)."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet
        # a tensor, counted in place: a compile of the whole model keeps it in its graph (an int
        # attribute would be a constant that recompiles at every call)
        self.register_buffer("computed", torch.zeros((), dtype=torch.long), persistent=False)
        self.dtype = torch.float32  # what ComfyUI's own diffusion models say

    @property
    def calls(self) -> int:
        return int(self.computed)

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        import comfy.patcher_extension as ext

        return ext.WrapperExecutor.new_class_executor(
            self._forward, self, ext.get_all_wrappers(ext.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timesteps, context, y, control, transformer_options, **kwargs)

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        out = self.unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]
        self.computed += 1
        return out


def comfy_model(denoiser):
    """A ModelPatcher of ComfyUI's SD1.5 BaseModel running the trained UNet."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.SD15(dict(
        image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1], channel_mult=[1, 2],
        transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1,
        use_spatial_transformer=True, legacy=False, use_linear_in_transformer=False, context_dim=32, num_heads=8,
        num_head_channels=-1, adm_in_channels=None, use_temporal_resblock=False, use_temporal_attention=False))
    model = comfy.model_base.BaseModel(config, device=torch.device("cpu"))
    model.diffusion_model = DigitsDiffusionModel(denoiser.unet)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _settings(base, log) -> list[tuple[str, str, object]]:
    """(group, setting, MODEL) in the order they run; each group's first is its uncached model."""
    from ..nodes.compile_unet import KilnCompileUNet
    from ..nodes.step_cache import KilnStepCache

    try:
        from comfy_extras.nodes_easycache import EasyCacheNode
    except ImportError:
        EasyCacheNode = None
        log("this ComfyUI has no EasyCache (comfy_extras/nodes_easycache.py): Kiln's rows only")

    def kiln_cache(model, method, threshold=-1.0):
        return KilnStepCache().apply(model, method=method, threshold=threshold)[0]

    def easycache(model, threshold):
        return EasyCacheNode.execute(model, reuse_threshold=threshold, start_percent=0.15, end_percent=0.95,
                                     verbose=False)[0]

    settings = [("eager", "no cache", base)]
    settings += [("eager", f"kiln {method} {t:g}", kiln_cache(base, method, t))
                 for method, thresholds in KILN_THRESHOLDS.items() for t in thresholds]
    if EasyCacheNode is not None:
        settings += [("eager", f"easycache {t:g}", easycache(base, t)) for t in EASYCACHE_THRESHOLDS]
    compiled = KilnCompileUNet().compile(base, mode="balanced")[0]
    settings += [("kiln compile", "no cache", compiled)]
    settings += [("kiln compile", f"kiln {method} default", kiln_cache(compiled, method)) for method in KILN_THRESHOLDS]
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    core = TorchCompileModel.execute(base, backend="inductor")[0]   # the node itself, as a workflow runs it
    settings += [("core compile", "no cache", core)]
    if EasyCacheNode is not None:
        settings += [("core compile", f"easycache {t:g}", easycache(core, t)) for t in (0.05, 0.2)]
    return settings


def run(seeds: int = 8, step_counts=STEP_COUNTS, groups=("eager", "kiln compile", "core compile"), log=print) -> dict:
    import_comfyui()
    import comfy.sample

    from ..testing import digits_unet

    denoiser = digits_unet.load_or_train(progress=lambda step, loss: log(f"  training: step {step}, loss {loss:.4f}"))
    base = comfy_model(denoiser)
    settings = [s for s in _settings(base, log) if s[0] in groups]
    model_counter = base.model.diffusion_model

    def sample(model, steps, seed):
        classes = torch.tensor([seed % 10])
        pos = [[denoiser.context(classes), {}]]
        neg = [[denoiser.context(torch.tensor([digits_unet.NULL_CLASS])), {}]]
        noise = torch.randn(1, 4, digits_unet.LATENT, digits_unet.LATENT, generator=torch.Generator().manual_seed(seed))
        return comfy.sample.sample(model, noise, steps, 4.0, "euler", "normal", pos, neg, torch.zeros_like(noise),
                                   disable_pbar=True, seed=seed)

    rows = []
    for steps in step_counts:
        references, uncached_s = {}, {}
        for group, setting, model in settings:
            t0 = time.perf_counter()
            sample(model, steps, seeds)   # untimed: pays this setting's compiles (a seed the timed runs never use)
            warmup = time.perf_counter() - t0
            outs, calls, seconds = [], 0, 0.0
            for seed in range(seeds):
                before = model_counter.calls
                t0 = time.perf_counter()
                outs.append(sample(model, steps, seed))
                seconds += time.perf_counter() - t0
                calls += model_counter.calls - before
            if group == "eager" and setting == "no cache":
                references = dict(enumerate(outs))
            if setting == "no cache":
                uncached_s[group] = seconds
            quality = [(psnr(out, references[seed]), ssim(out, references[seed])) for seed, out in enumerate(outs)]
            row = {"steps": steps, "group": group, "setting": setting, "calls": calls / seeds,
                   **summary(quality),
                   "seconds": seconds, "speedup": uncached_s[group] / seconds, "warmup_s": warmup}
            rows.append(row)
            log(format_row(row))
    return {"seeds": seeds, "rows": rows}


def format_row(row: dict) -> str:
    quality = "the reference" if (row["group"], row["setting"]) == ("eager", "no cache") else summary_line(row)
    return (f"{row['steps']:>3} steps  {row['group']:<13} {row['setting']:<24} {quality:<44} "
            f"calls {row['calls']:5.1f}  {row['speedup']:.2f}x wall-clock ({row['seconds']:.2f} s; "
            f"warm-up {row['warmup_s']:.1f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--groups", default="eager,kiln compile,core compile", help="which of the three groups to run")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with torch.inference_mode():
        result = run(args.seeds, groups=tuple(g.strip() for g in args.groups.split(",")),
                     log=lambda msg: print(msg, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
