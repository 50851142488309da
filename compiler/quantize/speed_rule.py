"""When quantizing a Linear pays on a GPU class: a size rule, with constants a GPU measurement recalibrates.

A quantized layer must not make the model slower than Kiln's unquantized compile (Quantize Model's
defaults promise that on a GPU). Its GEMM gains from the 8-bit tensor cores (fp8 and int8 run at twice
bf16's rate) and from moving half the weight bytes; it pays for quantizing its activations (a pass over
x, fused by Inductor into the op before it) and for the epilogue. So on a GPU a Linear layer stays in
high precision when (checked in this order):

- it feeds a norm: a modulation projection (AdaLN shift/scale, a ResNet's time embedding) makes one
  row per sample, and its error lands in every token's normalisation (FAMILY_ROWS, "sample" rows);
- its N or K is not a multiple of `align` (the 8-bit GEMMs' operand alignment: torch._scaled_mm wants 16);
- its GEMM is small: rows x N x K under `min_macs`, the rows estimated at the family's reference size
  (`rows_at_reference`): the saving, MACs / (8-bit rate), is then under what the quantization pass
  and its launch cost;
- under a weight-only scheme (int8_weight, int8_tensorwise), its rows exceed `weight_only_max_rows`:
  above the GPU's ridge point the GEMM is compute-bound, and converting each weight tile in the GEMM
  buys nothing over cuBLAS's 16-bit GEMM;
- it is a convolution and `convs` is false: Kiln's quantized convolutions are weight-only, their
  weight dequantized on every call.

One `GemmSpeedRule` per GPU class (SPEED_RULES, keyed "sm_<major><minor>"); a class not in the table
gets DEFAULT_RULE's constants. The constants are a size rule from each class's published 16-bit and
8-bit tensor-core rates, not yet measured (`source` says so); a measurement of the quantized GEMMs on
that class replaces them (benchmarks/gpu_session.sh quant, docs/quantization.md). Tests inject their
own record. On a CPU no rule applies unless one is asked for by name.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Optional

import torch

from .scheme import QuantizeError

RULE_NOT_MEASURED = "size rule from the class's tensor-core rates; not yet measured on this class"


@dataclass(frozen=True)
class GemmSpeedRule:
    """gpu_class: "sm_90", ...; min_macs: a quantized GEMM smaller than this (rows x N x K at the reference
    size) stays in high precision; align: N and K must be multiples of it; weight_only_max_rows: above this
    many rows a weight-only GEMM is compute-bound (kept); convs: quantizing a convolution pays; source:
    where the constants come from (a results file once measured)."""

    gpu_class: str
    min_macs: int
    align: int = 16
    weight_only_max_rows: int = 256
    convs: bool = False
    source: str = RULE_NOT_MEASURED

    def __post_init__(self):
        for key in ("min_macs", "align", "weight_only_max_rows"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "align" else 0):
                raise QuantizeError(f"speed rule {key} must be a whole number >= {1 if key == 'align' else 0}, got {value!r}")

    def keeps(self, layer: torch.nn.Module, rows: int, rows_why: str, weight_only: bool) -> Optional[str]:
        """None when quantizing `layer` (at `rows` rows, estimated as `rows_why` says) pays on this class,
        else the reason it stays in high precision."""
        if isinstance(layer, torch.nn.Conv2d):
            return None if self.convs else f"{self.gpu_class}: convolution (weight-only, dequantized per call)"
        N, K = layer.weight.shape
        if rows_why == SAMPLE_ROWS:
            return f"{self.gpu_class}: feeds a norm (per-sample modulation, {rows} rows)"
        if N % self.align or K % self.align:
            return f"{self.gpu_class}: odd shape (N {N}, K {K} not multiples of {self.align})"
        macs = rows * N * K
        if macs < self.min_macs:
            return f"{self.gpu_class}: small GEMM ({rows} {rows_why} rows x {N} x {K} < {self.min_macs:.2g} MACs)"
        if weight_only and rows > self.weight_only_max_rows:
            return (f"{self.gpu_class}: weight-only GEMM at {rows} {rows_why} rows is compute-bound "
                    f"(> {self.weight_only_max_rows} rows)")
        return None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Ada (sm_89: RTX 40xx, L4, L40S) has 2-4x less 16-bit throughput than Hopper for similar launch and
# memory costs, so a smaller GEMM already pays there; Ampere (sm_80/86) has int8 but no fp8 tensor cores.
DEFAULT_RULE = GemmSpeedRule("default", min_macs=2 ** 31)
SPEED_RULES: dict[str, GemmSpeedRule] = {r.gpu_class: r for r in (
    GemmSpeedRule("sm_80", min_macs=2 ** 30),
    GemmSpeedRule("sm_86", min_macs=2 ** 30),
    GemmSpeedRule("sm_89", min_macs=2 ** 30),
    GemmSpeedRule("sm_90", min_macs=2 ** 31),
    GemmSpeedRule("sm_100", min_macs=2 ** 31),
)}


def gpu_class(device: Optional[torch.device] = None) -> Optional[str]:
    """"sm_<major><minor>" of the CUDA device a model will run on (the current one by default); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def rule_for(name: str) -> GemmSpeedRule:
    """The rule of a GPU class: its row of SPEED_RULES, else DEFAULT_RULE's constants under its name."""
    if not isinstance(name, str) or not name.startswith("sm_") or not name[3:].isdigit():
        raise QuantizeError(f"layer policy gpu_rule {name!r} is not a GPU class; use auto, none or sm_<major><minor> "
                            f"(known: {', '.join(SPEED_RULES)})")
    return SPEED_RULES.get(name) or dataclasses.replace(DEFAULT_RULE, gpu_class=name)


# ---- rows a layer's GEMM sees at the family's reference size --------------------------------------------

SAMPLE_ROWS, TEXT_ROWS, IMAGE_ROWS = "per-sample", "text", "image"


@dataclass(frozen=True)
class Reference:
    """The size a family's rows are estimated at: batch (2 with CFG), image tokens at the model's first
    level (a UNet halves its side at each level below), text tokens of its conditioning."""

    batch: int
    image_tokens: int
    text_tokens: int


REFERENCES: dict[str, Reference] = {
    "sd_unet": Reference(2, 64 * 64, 77),          # SD1.x/2.x: 512² -> a 64² latent; CFG
    "sd_unet_xl": Reference(2, 128 * 128, 77),     # SDXL: 1024² -> a 128² latent; CFG
    "flux": Reference(1, 64 * 64, 512),            # 1024², 2x2 patches; guidance-distilled, no CFG; T5 512
    "mmdit": Reference(2, 64 * 64, 333),           # SD3 1024², 2x2 patches; CFG; CLIP 77 + T5 256
    "pixart": Reference(2, 64 * 64, 300),          # 1024², 2x2 patches; CFG; T5 300
    "generic": Reference(2, 64 * 64, 77),
}

# family -> [(pattern, rows kind)]: layers whose rows are not the image's tokens (first match wins)
_MODULATION = [("*.emb_layers.*", SAMPLE_ROWS), ("*.time_emb_proj", SAMPLE_ROWS), ("*_mod.lin", SAMPLE_ROWS),
               ("*.modulation.lin", SAMPLE_ROWS), ("*.adaLN_modulation.*", SAMPLE_ROWS), ("*.norm1.linear", SAMPLE_ROWS),
               ("*.norm1_context.linear", SAMPLE_ROWS), ("*.norm.linear", SAMPLE_ROWS)]
_TEXT_STREAM = [("*.ff_context.*", TEXT_ROWS), ("*.attn.add_*_proj", TEXT_ROWS), ("*.attn.to_add_out", TEXT_ROWS),
                ("*.txt_attn.*", TEXT_ROWS), ("*.txt_mlp.*", TEXT_ROWS), ("*.context_block.*", TEXT_ROWS)]
FAMILY_ROWS: dict[str, list[tuple[str, str]]] = {
    "sd_unet": _MODULATION + [("*.attn2.to_k", TEXT_ROWS), ("*.attn2.to_v", TEXT_ROWS)],
    "diffusers_unet": _MODULATION + [("*.attn2.to_k", TEXT_ROWS), ("*.attn2.to_v", TEXT_ROWS)],
    "flux": _MODULATION + _TEXT_STREAM,
    "mmdit": _MODULATION + _TEXT_STREAM,
    "pixart": _MODULATION + [("*.attn2.to_k", TEXT_ROWS), ("*.attn2.to_v", TEXT_ROWS)],
    "generic": [],
}


def rows_at_reference(module: torch.nn.Module, family: str) -> dict[str, tuple[int, str]]:
    """Linear layer name -> (rows its GEMM sees at the family's reference size, which rows: SAMPLE_ROWS,
    TEXT_ROWS or IMAGE_ROWS). A UNet's image rows shrink 4x per level below its first (unet_levels)."""
    xl = family in ("sd_unet", "diffusers_unet") and _has_any(module, ("label_emb", "add_embedding"))
    ref = REFERENCES["sd_unet_xl" if xl else ("sd_unet" if family == "diffusers_unet" else family)]
    levels = unet_levels(module)
    rows = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.Linear):
            continue
        kind = next((k for pattern, k in FAMILY_ROWS[family] if fnmatch.fnmatchcase(name, pattern)), IMAGE_ROWS)
        if kind == SAMPLE_ROWS:
            rows[name] = (ref.batch, kind)
        elif kind == TEXT_ROWS:
            rows[name] = (ref.batch * ref.text_tokens, kind)
        else:
            level = next((lv for prefix, lv in levels.items() if name.startswith(prefix)), 0)
            rows[name] = (max(1, ref.batch * ref.image_tokens // 4 ** level), kind)
    return rows


def unet_levels(module: torch.nn.Module) -> dict[str, int]:
    """Block name prefix -> its level (0: full latent resolution, +1 per downsampling) for ComfyUI's
    UNetModel (input_blocks / middle_block / output_blocks, a Downsample or Upsample inside a block) and
    diffusers' UNet2DConditionModel (down_blocks.i at level i, mid_block at the deepest, up_blocks.i back);
    {} for a model without them."""
    levels: dict[str, int] = {}
    if hasattr(module, "input_blocks") and hasattr(module, "output_blocks"):
        level = 0
        for i, block in enumerate(module.input_blocks):
            levels[f"input_blocks.{i}."] = level
            level += _holds(block, "Downsample")
        levels["middle_block."] = level
        for i, block in enumerate(module.output_blocks):
            levels[f"output_blocks.{i}."] = level
            level -= _holds(block, "Upsample")
    elif hasattr(module, "down_blocks") and hasattr(module, "up_blocks"):
        deepest = len(module.down_blocks) - 1
        levels.update({f"down_blocks.{i}.": i for i in range(len(module.down_blocks))})
        levels["mid_block."] = deepest
        levels.update({f"up_blocks.{i}.": max(0, deepest - i) for i in range(len(module.up_blocks))})
    return levels


def _holds(block: torch.nn.Module, class_word: str) -> int:
    return int(any(class_word in type(m).__name__ for m in block.modules()))


def _has_any(module: torch.nn.Module, names: tuple) -> bool:
    return any(getattr(module, name, None) is not None for name in names)
