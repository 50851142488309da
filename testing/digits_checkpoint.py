"""The digits denoiser as an SD1.5 checkpoint a ComfyUI server loads, for measuring the step cache
through a running server (benchmarks/step_cache_server.py).

ComfyUI recognises an SD1.5 UNet by its layout (320 model channels, 768-wide text context), so the
small UNet of testing/digits_unet.py cannot be loaded as one. This trains the UNet of a given SD1.5
checkpoint instead: ComfyUI's own UNetModel, starting from the file's weights (the random-weight test
checkpoint's, say), to denoise the same digits latents, conditioned on the file's own CLIP encoding of
PROMPT (one prompt per digit; the empty prompt for CFG's unconditional branch), and writes the
checkpoint again with that UNet and the file's CLIP and VAE untouched. Run it with a ComfyUI's Python:

    COMFYUI_PATH=~/ComfyUI ~/ComfyUI/venv/bin/python -m kiln.testing.digits_checkpoint \\
        --base ~/ComfyUI/models/checkpoints/rand_sd15_tiny.safetensors \\
        --out ~/ComfyUI/models/checkpoints/digits_sd15_tiny.safetensors

Training is the long part (about 25 minutes on 2 cores for the test checkpoint's 107M-parameter UNet):
the result is kept in Kiln's cache (~/.cache/kiln/, keyed by the base file's hash) and copied to --out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from . import digits_unet
from .comfyui_path import import_comfyui

VERSION = 1
PROMPT = "a handwritten digit {}"     # {} is the digit; the unconditional branch is ""
UNET_PREFIX = "model.diffusion_model."


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def cached_path(base: Path) -> Path:
    return digits_unet.cache_path().parent / f"digits-sd15-{file_hash(base)}-v{VERSION}.safetensors"


def contexts(clip) -> torch.Tensor:
    """(11, tokens, width): the CLIP encoding of PROMPT for digits 0-9, then of the empty prompt."""
    prompts = [PROMPT.format(d) for d in range(10)] + [""]
    return torch.cat([clip.encode_from_tokens(clip.tokenize(p)).float() for p in prompts])


def train(unet: torch.nn.Module, table: torch.Tensor, steps: int, batch: int, lr: float, log=print) -> float:
    """Epsilon prediction on SD1.5's schedule, as digits_unet.train; the loss at the end (a running mean)."""
    torch.manual_seed(0)
    latents, classes = digits_unet.digit_latents()
    unet.float().train().requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    alphas = digits_unet._alphas_cumprod()
    ema, start = None, time.perf_counter()
    with torch.enable_grad():
        for step in range(steps):
            idx = torch.randint(0, len(latents), (batch,))
            x0, c = latents[idx], classes[idx].clone()
            c[torch.rand(batch) < 0.1] = digits_unet.NULL_CLASS
            t = torch.randint(0, digits_unet.TRAIN_TIMESTEPS, (batch,))
            a = alphas[t].reshape(-1, 1, 1, 1)
            noise = torch.randn_like(x0)
            eps = unet(a.sqrt() * x0 + (1 - a).sqrt() * noise, t.float(), context=table[c])
            loss = torch.nn.functional.mse_loss(eps, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            if (step + 1) % 25 == 0:
                log(f"step {step + 1}/{steps}, loss {ema:.4f}, {time.perf_counter() - start:.0f} s")
    unet.eval().requires_grad_(False)
    return ema


def build(base: Path, steps: int, batch: int, lr: float, log=print) -> Path:
    """The trained checkpoint in Kiln's cache, trained and written there first if missing."""
    target = cached_path(base)
    if target.exists():
        return target
    import_comfyui()
    import comfy.sd
    from safetensors.torch import load_file, save_file

    model, clip, _, _ = comfy.sd.load_checkpoint_guess_config(str(base), output_vae=False, output_clip=True)
    if type(model.model).__name__ != "BaseModel" or model.model.model_config.unet_config.get("context_dim") != 768:
        raise SystemExit(f"{base}: not an SD1.5 checkpoint (ComfyUI reads it as {type(model.model_config).__name__})")
    with torch.inference_mode():
        table = contexts(clip)
    table = table.clone()  # out of inference mode, for autograd
    unet = model.model.diffusion_model
    log(f"training the UNet of {base.name} ({sum(p.numel() for p in unet.parameters()) / 1e6:.0f}M parameters) "
        f"on the digits: {steps} steps of {batch}")
    start = time.perf_counter()
    loss = train(unet, table, steps, batch, lr, log)
    tensors = load_file(str(base))
    trained = unet.state_dict()
    for key in [k for k in tensors if k.startswith(UNET_PREFIX)]:
        tensors[key] = trained[key[len(UNET_PREFIX):]].to(tensors[key].dtype).contiguous()
    report = {"version": VERSION, "base": base.name, "prompt": PROMPT, "steps": steps, "batch": batch, "lr": lr,
              "final_loss": loss, "seconds": time.perf_counter() - start}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"kiln_digits": json.dumps(report)})
    tmp.replace(target)
    log(f"trained in {report['seconds']:.0f} s, loss {loss:.4f}: {target}")
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Train an SD1.5 checkpoint's UNet on the digits (once) and write it.")
    parser.add_argument("--base", type=Path, required=True, help="an SD1.5 checkpoint (.safetensors) ComfyUI loads")
    parser.add_argument("--out", type=Path, required=True, help="where to write the trained checkpoint")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args(argv)
    if args.base.suffix != ".safetensors" or not args.base.is_file():
        parser.error(f"--base {args.base}: not a .safetensors file")
    if args.out.suffix != ".safetensors":
        parser.error(f"--out {args.out}: name a .safetensors file")
    if args.out.exists():
        parser.error(f"--out {args.out} exists; Kiln does not overwrite it")
    built = build(args.base, args.steps, args.batch, args.lr, log=lambda msg: print(msg, flush=True))
    shutil.copyfile(built, args.out)
    print(f"{args.out}: ready (prompt: '{PROMPT}', digit 0-9; negative: empty)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
