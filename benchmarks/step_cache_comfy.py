"""The step cache beside ComfyUI core's EasyCache, through ComfyUI's own sampling, on the trained digits
denoiser (testing/digits_unet.py). Run with a ComfyUI's Python, its tree on COMFYUI_PATH:

    COMFYUI_PATH=~/ComfyUI ~/ComfyUI/venv/bin/python -m kiln.benchmarks.step_cache_comfy [--json PATH]

The trained UNet (diffusers) stands in for an SD1.5 checkpoint's: ComfyUI's SD1.5 BaseModel (eps, the
same scaled-linear schedule it was trained on) runs it as its diffusion model, behind ComfyUI's
DIFFUSION_MODEL wrappers as ComfyUI's own UNet is (EasyCache rides on those), with the class
embeddings as the conditioning. For each setting, at 20 and 30 steps (euler, normal, CFG 4), 8 seeds:
PSNR of the final latents against the uncached run of the same seed, and the diffusion model's calls
(counted at the model: every skipped call is one less), eager. Side by side in one process.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

KILN_THRESHOLDS = (0.03, 0.05, 0.08)
EASYCACHE_THRESHOLDS = (0.05, 0.1, 0.2)   # core's default is 0.2
STEP_COUNTS = (20, 30)


def _comfy():
    path = os.environ.get("COMFYUI_PATH")
    if not path or not os.path.isdir(os.path.join(path, "comfy")):
        raise SystemExit("set COMFYUI_PATH to a ComfyUI tree and run this with its Python")
    sys.path.insert(0, path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # what `main.py --cpu` sets, before model_management reads it


class DigitsDiffusionModel(torch.nn.Module):
    """The trained UNet called as ComfyUI calls its diffusion model, DIFFUSION_MODEL wrappers included."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet
        self.calls = 0
        self.dtype = torch.float32  # what ComfyUI's own diffusion models say

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        import comfy.patcher_extension as ext

        return ext.WrapperExecutor.new_class_executor(
            self._forward, self, ext.get_all_wrappers(ext.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timesteps, context, y, control, transformer_options, **kwargs)

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        self.calls += 1
        return self.unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]


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


def run(seeds: int = 8, log=print) -> dict:
    _comfy()
    import comfy.sample

    from ..nodes.step_cache import KilnStepCache
    from ..testing import digits_unet
    from ..testing.image_quality import psnr

    try:
        from comfy_extras.nodes_easycache import EasyCacheNode
    except ImportError:
        EasyCacheNode = None
        log("this ComfyUI has no EasyCache (comfy_extras/nodes_easycache.py): Kiln's rows only")
    denoiser = digits_unet.load_or_train(progress=lambda step, loss: log(f"  training: step {step}, loss {loss:.4f}"))
    base = comfy_model(denoiser)
    settings = [("no cache", None, base)]
    settings += [("kiln", t, KilnStepCache().apply(base, threshold=t)[0]) for t in KILN_THRESHOLDS]
    if EasyCacheNode is not None:
        settings += [("easycache", t, EasyCacheNode.execute(base, reuse_threshold=t, start_percent=0.15, end_percent=0.95,
                                                            verbose=False)[0]) for t in EASYCACHE_THRESHOLDS]
    model_counter = base.model.diffusion_model
    rows = []
    for steps in STEP_COUNTS:
        references = {}
        for name, threshold, model in settings:
            values, calls = [], 0
            for seed in range(seeds):
                classes = torch.tensor([seed % 10])
                pos = [[denoiser.context(classes), {}]]
                neg = [[denoiser.context(torch.tensor([digits_unet.NULL_CLASS])), {}]]
                noise = torch.randn(1, 4, digits_unet.LATENT, digits_unet.LATENT, generator=torch.Generator().manual_seed(seed))
                before = model_counter.calls
                out = comfy.sample.sample(model, noise, steps, 4.0, "euler", "normal", pos, neg,
                                          torch.zeros_like(noise), disable_pbar=True, seed=seed)
                calls += model_counter.calls - before
                if threshold is None:
                    references[seed] = out
                values.append(psnr(out, references[seed]))
            row = {"steps": steps, "cache": name, "threshold": threshold, "psnr_min": min(values),
                   "psnr_mean": sum(values) / len(values), "calls": calls / seeds}
            rows.append(row)
            quality = "" if threshold is None else f"PSNR min {row['psnr_min']:5.1f} mean {row['psnr_mean']:5.1f} dB  "
            setting = name if threshold is None else f"{name} {threshold:g}"
            log(f"{steps:>3} steps  {setting:<16} {quality:<32}model calls {row['calls']:5.1f} of {steps}")
    return {"seeds": seeds, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with torch.inference_mode():
        result = run(args.seeds, log=lambda msg: print(msg, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
