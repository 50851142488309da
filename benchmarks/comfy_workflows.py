"""The example workflows' speed paths side by side in one ComfyUI process, for one model (SD1.5, SDXL or
Flux with random weights), through ComfyUI's own model classes, patching, samplers and nodes:

    python -m kiln.benchmarks.comfy_workflows --comfyui PATH --model sd15|sdxl|flux [--size tiny|full]
        [--device cpu|cuda] [--steps 8] [--memory-gb 16 --reserve-vram 1] [--dynamic-vram] [--via-file] [--tag NAME]

Rows (VARIANTS), each the node chain a workflow builds, run in this order: eager; core's EasyCache;
core's TorchCompileModel (inductor); core's EasyCache after it; Kiln › Compile UNet as shipped (its
node's defaults); core's EasyCache after it; Kiln › Step Cache after it. Per row: seconds per step
(one untimed sampling first, which pays the row's compiles: its seconds are the row's warm-up), and
the final latents' PSNR against eager's after the same `--steps` (8 by default), same seed and noise.

Then, on Kiln's model (KILN_CHECKS; Kiln's own stats, graphs compiled and recompiles before and after):
a LoRA after Kiln at two strengths (LORA_STRENGTHS), a second resolution, batch 2, a ControlNet and an
IPAdapter-style attention patch in the chain (each image against eager's with the same chain); and
the time to the first latents of fresh processes (COLD_RUNS): eager, Kiln cold (empty caches) and
Kiln after a restart from Kiln's cache (Kiln › Cache Graph, Inductor's cache empty again).

A model is built from ComfyUI's own classes with random weights (seeded) on the device, at ComfyUI's
full layout (`--size full`, the default on CUDA) or a tiny one (`--size tiny`, the CPU beds);
`--via-file` saves it and loads it back through ComfyUI's diffusion-model loader (model detection
included; full size only, tiny layouts are not detectable). The text encoders and the VAE are left
out: conditioning is random tensors of the encoders' shapes, and a row's "image" is its latents.
`--memory-gb G` caps the process's CUDA memory at G GiB (torch.cuda.set_per_process_memory_fraction),
`--reserve-vram` is ComfyUI's own flag. Under a cap each row says how ComfyUI loaded the model (`load`: all of
it, or part under its partial load), its CUDA memory peak, Kiln's memory verdict (nodes/partial_load.py: the
blocks ComfyUI streams run eagerly) and, where it ran out of memory, `out_of_memory` instead of its times.
`--dynamic-vram` starts ComfyUI's dynamic VRAM as main.py does (CUDA, ComfyUI 0.33+): eager and core's rows then
run on core's default loading, Kiln on the non-dynamic copy it takes in a server. Writes <out>/<date>-<device>-comfyui[-<tag>].json and .log.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).parent / "results"
FAMILIES = ("sd15", "sdxl", "flux")
SIZES = ("tiny", "full")
LORA_STRENGTHS = (0.5, 1.0)
EASYCACHE = dict(reuse_threshold=0.2, start_percent=0.15, end_percent=0.95)   # core's defaults
SEED = 3
COLD_RUNS = ("eager", "kiln cold", "kiln from its cache")
CHILD_MARK = "FIRST_LATENTS "   # the line a fresh process prints with its time to the first latents

# ComfyUI's own layouts (what its model detection reports for the released checkpoints), and tiny ones.
UNET_CONFIGS = {
    ("sd15", "full"): dict(image_size=32, in_channels=4, out_channels=4, model_channels=320,
                           num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                           transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1,
                           use_spatial_transformer=True, legacy=False, use_linear_in_transformer=False, context_dim=768,
                           num_heads=8, num_head_channels=-1, adm_in_channels=None, use_temporal_resblock=False,
                           use_temporal_attention=False),
    ("sd15", "tiny"): dict(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                           channel_mult=[1, 2], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                           transformer_depth_middle=1, use_spatial_transformer=True, legacy=False,
                           use_linear_in_transformer=False, context_dim=32, num_heads=8, num_head_channels=-1,
                           adm_in_channels=None, use_temporal_resblock=False, use_temporal_attention=False),
    ("sdxl", "full"): dict(image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[2, 2, 2],
                           channel_mult=[1, 2, 4], transformer_depth=[0, 0, 2, 2, 10, 10],
                           transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], transformer_depth_middle=10,
                           use_spatial_transformer=True, legacy=False, use_linear_in_transformer=True, context_dim=2048,
                           num_heads=-1, num_head_channels=64, adm_in_channels=2816, num_classes="sequential", use_temporal_resblock=False,
                           use_temporal_attention=False),
    ("sdxl", "tiny"): dict(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                           channel_mult=[1, 2], transformer_depth=[0, 1], transformer_depth_output=[0, 0, 1, 1],
                           transformer_depth_middle=1, use_spatial_transformer=True, legacy=False,
                           use_linear_in_transformer=True, context_dim=2048, num_heads=-1, num_head_channels=16,
                           adm_in_channels=2816, num_classes="sequential", use_temporal_resblock=False, use_temporal_attention=False),
    ("flux", "full"): dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
                           hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38,
                           axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
                           txt_ids_dims=[]),
    ("flux", "tiny"): dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=16, context_in_dim=32,
                           hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6],
                           theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, txt_ids_dims=[]),
}


@dataclass(frozen=True)
class Family:
    config_class: str      # in comfy.supported_models
    latent_channels: int
    context_len: int
    cfg: float             # Flux-dev runs without CFG (guidance embedded)
    full_latent: int       # latent side at the family's native resolution (pixels / 8)
    pooled: int = 0        # the pooled text embedding's width (SDXL's clip_pooled; Flux's vec_in_dim)


FAMILY = {
    "sd15": Family("SD15", 4, 77, 7.0, 64),
    "sdxl": Family("SDXL", 4, 77, 7.0, 128, pooled=1280),
    "flux": Family("Flux", 16, 512, 1.0, 128),     # T5 tokens as Flux-dev pads them
}
TINY_LATENT = 16


def latent_side(args) -> int:
    return FAMILY[args.model].full_latent if args.size == "full" else TINY_LATENT


def import_comfyui(args) -> None:
    """The tree first on the import path, with the process-wide settings ComfyUI reads at import (what
    main.py's flags set): --cpu and SDPA attention on a CPU, --reserve-vram, then the memory cap."""
    path = str(Path(args.comfyui).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = args.device == "cpu"
    comfy.cli_args.args.use_pytorch_cross_attention = args.device == "cpu"
    if args.memory_gb and args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gb * 2**30 / total))
        if args.reserve_vram is None:   # ComfyUI sizes its loading by the card's free memory, not the cap
            args.reserve_vram = max(0.0, total / 2**30 - args.memory_gb)
    if args.reserve_vram is not None:
        comfy.cli_args.args.reserve_vram = args.reserve_vram
    if args.dynamic_vram:
        start_dynamic_vram(args)
    from ..nodes import block_inputs

    block_inputs.register()   # what loading Kiln's node pack does in a server


def start_dynamic_vram(args) -> None:
    """What ComfyUI's main.py does on an NVIDIA card (ComfyUI 0.33+ with comfy-aimdo): comfy-aimdo started with
    ComfyUI's reserve as its VRAM headroom (how a cap holds for the weights it streams, which the caching
    allocator's memory fraction does not see), the device registered, ModelPatcherDynamic the core patcher. Then
    eager and core's rows run on core's default (dynamic VRAM, whose streamed weights a compile must not trace);
    Kiln and core's TorchCompileModel take the non-dynamic copy, as in a server. Fails naming what is missing."""
    try:
        import comfy_aimdo.control as aimdo
        import comfy.memory_management
        import comfy.model_patcher
    except ImportError as exc:
        raise SystemExit(f"--dynamic-vram: this ComfyUI has no dynamic VRAM ({exc}); ComfyUI 0.33+ with comfy-aimdo")
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 2**30)
    try:
        started = aimdo.init(simple_vram_headroom=headroom, nvml_pressure=True)
    except TypeError:   # comfy-aimdo 0.4.9's protocol
        started = aimdo.init()
    import comfy.model_management as mm

    if not started or not aimdo.init_devices(d.index for d in mm.get_all_torch_devices()):
        raise SystemExit("--dynamic-vram: comfy-aimdo did not start on this device (its log above says why)")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


def dtype_of(args):
    if args.device == "cpu":
        return torch.float32
    return torch.bfloat16 if args.model == "flux" else torch.float16


def build_model(args, log=print):
    """A ModelPatcher of the family's ComfyUI model with seeded random weights (see the module's docstring)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    config = getattr(comfy.supported_models, FAMILY[args.model].config_class)(dict(UNET_CONFIGS[args.model, args.size]))
    config.set_inference_dtype(dtype_of(args), None)
    device, offload = mm.get_torch_device(), mm.unet_offload_device()
    torch.manual_seed(0)
    # built where ComfyUI's loader puts a model (its offload device: ComfyUI moves it to the GPU as memory
    # allows, so a memory cap holds from the start); the random values are drawn on the device
    model = config.get_model({}, device=offload)
    model.diffusion_model.to(dtype=dtype_of(args))
    with torch.no_grad():
        for p in model.diffusion_model.parameters():   # ComfyUI's ops leave weights uninitialised
            p.copy_(torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0, 0.02))
    if args.via_file:
        import comfy.sd
        import safetensors.torch

        path = Path(tempfile.mkdtemp(prefix="kiln-comfy-model-")) / f"{args.model}.safetensors"
        safetensors.torch.save_file({k: v.contiguous() for k, v in model.diffusion_model.state_dict().items()}, path)
        del model
        options = {"dtype": torch.float8_e4m3fn} if args.weight_dtype == "fp8" else {}
        patcher = comfy.sd.load_diffusion_model(str(path), model_options=options)
        log(f"loaded back through comfy.sd.load_diffusion_model: {type(patcher.model).__name__}, {path.stat().st_size / 2**30:.1f} GiB")
        path.unlink()
        return patcher
    patcher = comfy.model_patcher.CoreModelPatcher if args.dynamic_vram else comfy.model_patcher.ModelPatcher
    return patcher(model, load_device=device, offload_device=offload)


def conditioning(args, batch: int = 1):
    """(positive, negative) in ComfyUI's CONDITIONING format, random tensors of the text encoders' shapes."""
    family, unet = FAMILY[args.model], UNET_CONFIGS[args.model, args.size]
    width = unet.get("context_dim") or unet["context_in_dim"]
    pooled = family.pooled or unet.get("vec_in_dim", 0)
    gen = torch.Generator().manual_seed(SEED)

    def one():
        extra = {"pooled_output": torch.randn(batch, pooled, generator=gen)} if pooled else {}
        if args.model == "flux":
            extra["guidance"] = 3.5
        return [[torch.randn(batch, family.context_len, width, generator=gen), extra]]
    return one(), one()


def sample(args, model, steps: int, batch: int = 1, side: tuple[int, int] | None = None, positive=None, negative=None):
    """ComfyUI's sampler (euler, normal) from seeded noise: the final latents."""
    import comfy.sample

    height, width = side or (latent_side(args),) * 2
    noise = torch.randn(batch, FAMILY[args.model].latent_channels, height, width,
                        generator=torch.Generator().manual_seed(SEED))
    if positive is None:
        positive, negative = conditioning(args)
    return comfy.sample.sample(model, noise, steps, FAMILY[args.model].cfg, "euler", "normal", positive, negative,
                               torch.zeros_like(noise), disable_pbar=True, seed=SEED)


def kiln_stats(model):
    """The stats of the Kiln model a MODEL with Kiln's compile runs (None before its first run)."""
    from ..compiler import model_for
    from ..nodes.plan_wrapper import WRAPPER_KEY

    wrappers = model.get_wrappers("apply_model", WRAPPER_KEY)
    if not wrappers:
        return None
    return model_for(model.get_model_object("diffusion_model"), wrappers[0].plan).stats


def _easycache(model):
    from comfy_extras.nodes_easycache import EasyCacheNode

    return EasyCacheNode.execute(model, verbose=False, **EASYCACHE)[0]


def _core_compile(model):
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    return TorchCompileModel.execute(model, backend="inductor")[0]


def _kiln(model, advanced: str = ""):
    from ..nodes.compile_unet import KilnCompileUNet

    return KilnCompileUNet().compile(model, advanced=advanced)[0]   # the node's defaults, as a workflow adds it


def _step_cache(model):
    from ..nodes.step_cache import KilnStepCache

    return KilnStepCache().apply(model)[0]


# row -> (the row it builds on, the node applied)
VARIANTS: dict[str, tuple[str | None, Callable | None]] = {
    "eager": (None, None),
    "eager + easycache": ("eager", _easycache),
    "core compile": ("eager", _core_compile),
    "core compile + easycache": ("core compile", _easycache),
    "kiln": ("eager", _kiln),
    "kiln + easycache": ("kiln", _easycache),
    "kiln + step cache": ("kiln", _step_cache),
}
NEEDS = {_easycache: "comfy_extras.nodes_easycache", _core_compile: "comfy_extras.nodes_torch_compile"}


def has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def run_rows(args, base, log) -> tuple[list[dict], dict]:
    models, rows, reference = {}, [], None
    for name, (parent, node) in VARIANTS.items():
        if name not in args.variants:
            continue
        if parent is not None and parent not in models:
            rows.append({"variant": name, "skipped": f"needs the row {parent}"})
            continue
        if node in NEEDS and not has_module(NEEDS[node]):
            rows.append({"variant": name, "skipped": f"this ComfyUI has no {NEEDS[node]}"})
            log(f"{name}: skipped, this ComfyUI has no {NEEDS[node]}")
            continue
        model = base if node is None else node(models[parent], args.kiln_advanced) if node is _kiln \
            else node(models[parent])
        models[name] = model
        peak_from()
        try:
            t0 = time.perf_counter()
            sample(args, model, args.steps)
            warmup = time.perf_counter() - t0
            t0 = time.perf_counter()
            latents = sample(args, model, args.steps)
            seconds = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError as exc:   # under --memory-gb: the row's answer, and the next rows still run
            row = {"variant": name, "out_of_memory": str(exc)[:300], "load": load_of(model), "peak_gib": peak_from()}
            rows.append(row)
            log(format_row(row))
            free_device()
            continue
        if name == "eager":
            reference = latents
        row = {"variant": name, "s_per_it": seconds / args.steps, "warmup_s": warmup,
               "psnr_db": None if reference is None or name == "eager" else _psnr(latents, reference),
               "load": load_of(model), "peak_gib": peak_from()}
        stats = kiln_stats(model) if name.startswith("kiln") else None
        if stats is not None:
            memory = stats.memory
            row["kiln"] = {"graphs": stats.compile_count, "recompiles": len(stats.recompiles),
                           "recompile_reasons": sorted({c.reason[:200] for c in stats.recompiles}),
                           "fallback": stats.fallback, "eager_calls": stats.eager_calls,
                           "regions_eager": stats.regions_eager,
                           "memory": None if memory is None else {"fits": memory.fits, "why": memory.why,
                                                                   "blocks_eager": len(memory.eager_blocks),
                                                                   "cuda_graphs": memory.cuda_graphs}}
        rows.append(row)
        log(format_row(row))
    return rows, models


def load_of(model) -> dict:
    """How ComfyUI loaded the row's model for its last sampling: its bytes on the device of all its bytes (fewer
    under its partial load, or dynamic VRAM's streaming)."""
    size, loaded = model.model_size(), model.loaded_size()
    return {"model_bytes": size, "loaded_bytes": loaded, "partly": loaded < size}


def peak_from() -> float | None:
    """The CUDA memory peak since the last call, in GiB (None off CUDA); the peak starts again from here."""
    if not torch.cuda.is_available():
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return round(peak, 3)


def free_device() -> None:
    """After a row ran out of memory: every model off the device and the allocator's cache freed, as ComfyUI does
    after a failed prompt."""
    import comfy.model_management as mm

    mm.unload_all_models()
    mm.soft_empty_cache()


def _psnr(out, ref) -> float | str:
    """PSNR in dB, rounded; "identical" where the latents are bit for bit eager's (infinite PSNR, which JSON lacks)."""
    from ..testing.image_quality import psnr

    value = float(psnr(out.float(), ref.float()))
    return "identical" if value == float("inf") else round(value, 2)


def _db(value) -> str:
    return value if isinstance(value, str) else f"{value:.1f} dB"


def format_row(row: dict) -> str:
    if "skipped" in row:
        return f"{row['variant']:<26} skipped: {row['skipped']}"
    if "out_of_memory" in row:
        return f"{row['variant']:<26} OUT OF MEMORY ({_load_words(row['load'])}): {row['out_of_memory'][:160]}"
    quality = "the reference" if row["psnr_db"] is None else f"{_db(row['psnr_db'])} vs eager"
    kiln = row.get("kiln")
    extra = f"  (Kiln: {kiln['graphs']} graph(s), {kiln['recompiles']} recompile(s))" if kiln else ""
    memory = (kiln or {}).get("memory") or {}
    if memory.get("why"):
        extra += f"\n{'':<27}Kiln's memory verdict: {memory['why']}"
    load = f"  [{_load_words(row['load'])}]" if row.get("load", {}).get("partly") else ""
    return (f"{row['variant']:<26} {row['s_per_it']:8.4f} s/it  warm-up {row['warmup_s']:7.1f} s  {quality}{load}"
            f"{extra}")


def _load_words(load: dict) -> str:
    return f"ComfyUI loaded {load['loaded_bytes'] / 2**30:.2f} of {load['model_bytes'] / 2**30:.2f} GiB"


def _controlnet(args, model):
    """A random-weight ControlNet of the UNet's layout (ComfyUI's cldm), as ControlNetLoader returns one."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.model_management as mm
    import comfy.ops

    unet = {k: v for k, v in UNET_CONFIGS[args.model, args.size].items()
            if k not in ("out_channels", "transformer_depth_output", "use_temporal_attention", "use_temporal_resblock")}
    torch.manual_seed(7)
    network = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, **unet)
    with torch.no_grad():
        for p in network.parameters():
            p.normal_(0, 0.02)
    network.to(dtype=dtype_of(args))
    return comfy.controlnet.ControlNet(network, load_device=mm.get_torch_device())


def _attention_patch(model):
    """An IPAdapter-style patch: something added to every cross-attention's output (set_model_attn2_output_patch)."""
    patched = model.clone()

    def add_scaled(out, extra_options):
        return out + 0.1 * out.flip(-1)
    patched.set_model_attn2_output_patch(add_scaled)
    return patched


def lora_patches(model, scale: float = 0.02) -> dict:
    """A LoRA-like 'diff' on every attention q and v projection (what a LoRA loader hands add_patches)."""
    gen = torch.Generator().manual_seed(5)
    sd = model.model.state_dict()
    return {k: (torch.randn(sd[k].shape, generator=gen).to(sd[k].dtype) * scale,)
            for k in sd if k.endswith(("to_q.weight", "to_v.weight", "img_attn.qkv.weight"))}


def run_checks(args, models: dict, log) -> list[dict]:
    """KILN_CHECKS on Kiln's model, each against eager with the same chain."""
    if "kiln" not in models:
        return []
    kiln, eager = models["kiln"], models["eager"]
    side = latent_side(args)
    checks = []

    def check(name, kiln_model, eager_model, note="", **kw):
        stats = kiln_stats(kiln_model)
        before = (stats.compile_count, len(stats.recompiles)) if stats else (0, 0)
        got = sample(args, kiln_model, args.check_steps, **kw)
        stats = kiln_stats(kiln_model)
        want = sample(args, eager_model, args.check_steps, **kw)
        row = {"check": name, "psnr_db": _psnr(got, want), "new_graphs": stats.compile_count - before[0],
               "new_recompiles": len(stats.recompiles) - before[1], "fallback": stats.fallback,
               "recompile_reasons": sorted({c.reason[:200] for c in stats.recompiles[before[1]:]}),
               "region_fallbacks": dict(stats.region_fallbacks), "note": note}
        checks.append(row)
        log(f"check {name:<28} {_db(row['psnr_db']):>9} vs eager  {row['new_graphs']} new graph(s), "
            f"{row['new_recompiles']} recompile(s)" + (f"  fallback: {row['fallback']}" if row["fallback"] else "")
            + (f"  regions eager: {row['region_fallbacks']}" if row["region_fallbacks"] else "") + (f"  {note}" if note else ""))

    patches = lora_patches(kiln)
    for strength in LORA_STRENGTHS:
        lora_kiln, lora_eager = kiln.clone(), eager.clone()
        lora_kiln.add_patches(patches, strength)
        lora_eager.add_patches(patches, strength)
        check(f"LoRA after Kiln at {strength:g}", lora_kiln, lora_eager)
    check("second resolution", kiln, eager, side=(side, side * 3 // 4 // 2 * 2 or 2))
    positive, negative = conditioning(args, batch=1)
    check("batch 2", kiln, eager, batch=2, positive=positive, negative=negative)
    if args.model == "flux":
        checks.append({"check": "ControlNet", "skipped": "no Flux ControlNet is built here (SD1.5 and SDXL only)"})
        log("check ControlNet: skipped, no Flux ControlNet is built here")
    else:
        import nodes

        control = _controlnet(args, kiln)
        hint = torch.rand(1, side * 8, side * 8, 3, generator=torch.Generator().manual_seed(9))
        cpos, cneg = nodes.ControlNetApplyAdvanced().apply_controlnet(*conditioning(args), control, hint, 0.8, 0.0, 1.0)
        check("ControlNet in the chain", kiln, eager, positive=cpos, negative=cneg)
    if args.model == "flux":
        checks.append({"check": "attention patch", "skipped": "attn2 patches are the UNet's (SD1.5 and SDXL)"})
    else:
        check("attention patch after Kiln", _attention_patch(kiln), _attention_patch(eager))
    return checks


def cold_starts(args, log) -> list[dict]:
    """COLD_RUNS, each a fresh process with its own empty Inductor cache; the two Kiln runs share one Kiln
    cache directory (empty for the first)."""
    folder = Path(tempfile.mkdtemp(prefix="kiln-comfy-cold-"))
    kiln_cache = folder / "kiln-cache"
    kiln_cache.mkdir(mode=0o700)
    rows = []
    for number, run in enumerate(COLD_RUNS):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / f"inductor-{number}"),
               "KILN_CACHE_DIR": str(kiln_cache), "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "kiln.benchmarks.comfy_workflows", "--comfyui", str(args.comfyui),
                   "--model", args.model, "--size", args.size, "--device", args.device, "--steps", str(args.steps),
                   "--child", "eager" if run == "eager" else "kiln", "--t0", repr(time.time())]
        if args.via_file:
            command += ["--via-file", "--weight-dtype", args.weight_dtype]
        if args.kiln_advanced:
            command += ["--kiln-advanced", args.kiln_advanced]
        if args.dynamic_vram:
            command += ["--dynamic-vram"]
        if args.memory_gb:   # the same card-sized budget (and ComfyUI's reserve for it)
            command += ["--memory-gb", str(args.memory_gb)]
        if args.reserve_vram is not None:
            command += ["--reserve-vram", str(args.reserve_vram)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.child_timeout)
        line = next((x for x in done.stdout.splitlines() if x.startswith(CHILD_MARK)), None)
        if done.returncode != 0 or line is None:
            rows.append({"run": run, "failed": (done.stderr or done.stdout)[-1500:]})
            log(f"cold start {run}: FAILED\n{rows[-1]['failed']}")
            continue
        rows.append({"run": run, **json.loads(line[len(CHILD_MARK):])})
        log(f"cold start {run:<22} first latents after {rows[-1]['first_latents_s']:.1f} s "
            f"(imports and model {rows[-1]['ready_s']:.1f} s)" + (f"; Kiln's cache: {rows[-1]['cache']}"
                                                                   if rows[-1].get("cache") else ""))
    return rows


def child(args) -> int:
    """One cold run: import, build, (Kiln's compile and Cache Graph), one sampling; prints CHILD_MARK + JSON."""
    import_comfyui(args)
    with torch.inference_mode():
        model = build_model(args, log=lambda msg: None)
        ready = time.time() - args.t0
        cache = ""
        if args.child == "kiln":
            from ..nodes.cache_graph import KilnCacheGraph

            model, cache = KilnCacheGraph().cache(_kiln(model, args.kiln_advanced))
        sample(args, model, args.steps)
        stats = kiln_stats(model) if args.child == "kiln" else None
        events = [e.line() for e in stats.cache] if stats else []
    said = ("; ".join(events[:4]) or cache.strip()[:300]).replace(os.environ.get("KILN_CACHE_DIR") or "\0",
                                                                   "$KILN_CACHE_DIR")   # no path of this machine
    print(CHILD_MARK + json.dumps({"first_latents_s": time.time() - args.t0, "ready_s": ready, "cache": said}))
    return 0


def device_name(args) -> str:
    if args.device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    known = re.search(r"\b([ahlb]\d{2,3}[a-z]*|rtx ?\d{4}|\d{4})\b", name)
    return re.sub(r"[^a-z0-9]+", "", known.group(1) if known else name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI tree")
    parser.add_argument("--model", choices=FAMILIES, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=SIZES, help="full on CUDA, tiny on a CPU by default")
    parser.add_argument("--steps", type=int, default=8, help="sampling steps per row (the PSNR is over these)")
    parser.add_argument("--check-steps", type=int, default=2, help="sampling steps per Kiln check")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {', '.join(VARIANTS)}")
    parser.add_argument("--no-checks", action="store_true", help="the rows only")
    parser.add_argument("--kiln-advanced", default="", help="Compile UNet's advanced text for the Kiln rows (e.g. "
                        "'measure_regions: false': every region compiled, where a CPU would keep them eager)")
    parser.add_argument("--no-cold", action="store_true", help="no fresh-process runs")
    parser.add_argument("--memory-gb", type=float, help="cap this process's CUDA memory at this many GiB")
    parser.add_argument("--reserve-vram", type=float, help="ComfyUI's --reserve-vram (GiB); with --memory-gb, by "
                        "default what the card has beyond the cap (ComfyUI plans by the card's free memory)")
    parser.add_argument("--dynamic-vram", action="store_true", help="start ComfyUI's dynamic VRAM (comfy-aimdo) as its "
                        "main.py does on an NVIDIA card: eager and core's rows on core's default loading (CUDA only)")
    parser.add_argument("--via-file", action="store_true", help="load the model through ComfyUI's loader (full size)")
    parser.add_argument("--weight-dtype", choices=("default", "fp8"), default="default",
                        help="fp8: ComfyUI loads the weights as float8_e4m3fn (with --via-file)")
    parser.add_argument("--tag", default="", help="added to the results' file names (e.g. the ComfyUI version)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=("eager", "kiln"), help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--child-timeout", type=float, default=900.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "tiny")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; use {', '.join(VARIANTS)}")
    if not (args.comfyui / "comfy").is_dir():
        parser.error(f"--comfyui {args.comfyui}: not a ComfyUI tree (no comfy/)")
    if args.steps < 1 or args.check_steps < 1:
        parser.error("--steps and --check-steps must be at least 1")
    if args.via_file and args.size != "full":
        parser.error("--via-file needs --size full: ComfyUI's model detection does not read the tiny layouts")
    if args.dynamic_vram and args.device != "cuda":
        parser.error("--dynamic-vram needs --device cuda (comfy-aimdo streams weights to a CUDA device)")
    if args.weight_dtype == "fp8" and not args.via_file:
        parser.error("--weight-dtype fp8 needs --via-file (ComfyUI casts the weights as it loads them)")
    if args.child:
        return child(args)

    stem = f"{datetime.date.today():%Y-%m-%d}-{device_name(args)}-comfyui" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / f"{stem}.log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    import_comfyui(args)
    import comfyui_version

    settings = {"model": args.model, "size": args.size, "device": args.device, "dtype": str(dtype_of(args)),
                "steps": args.steps, "check_steps": args.check_steps, "latent": latent_side(args),
                "comfyui": comfyui_version.__version__, "torch": torch.__version__,
                "memory_gb": args.memory_gb, "reserve_vram": args.reserve_vram, "via_file": args.via_file,
                "dynamic_vram": args.dynamic_vram,
                "weight_dtype": args.weight_dtype, "kiln_advanced": args.kiln_advanced}
    log(json.dumps(settings))
    result = {"settings": settings, "rows": [], "checks": [], "cold_starts": []}

    def save(part: str, value) -> None:   # after each part: a run cut short keeps what it measured
        result[part] = value
        if args.device == "cuda":
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str))

    with torch.inference_mode():
        base = build_model(args, log)
        rows, models = run_rows(args, base, log)
        save("rows", rows)
        if not args.no_checks:
            save("checks", run_checks(args, models, log))
    if not args.no_cold:
        save("cold_starts", cold_starts(args, log))
    log(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
