"""Which layers to quantize: a family's defaults, a size threshold and the user's YAML override.

Quantizing everything ruins images and can be slower, so a layer stays in high precision when it
matters most and costs least:
- the model's first and last layers, its time/label/text embeddings and (DiT) its output
  modulation: a family default, by name pattern (FAMILY_KEEP);
- layers under `min_params` weights (default 16384): their GEMMs are too small to gain anything;
- convolutions when `convs` is false, and always under fp8_e4m3 and int8_tensorwise (ComfyUI's
  formats have Linear layers only, and a Kiln file in ComfyUI's format must load in stock ComfyUI);
- names matching a `keep` pattern. A `quantize` pattern forces a layer in, over the defaults and
  the size threshold (never over the ComfyUI formats' rule);
- on a GPU, layers whose quantized GEMM would not be faster there (`gpu_rule`: speed_rule.py's size
  rule for the GPU class: small or odd-shaped GEMMs, projections that feed norms, convolutions).
  "auto" (the default, also Quantize Model's) applies the rule of the CUDA GPU present and none on a
  CPU; "none" never applies one; "sm_90" (any GPU class) applies that class's rule anywhere.

Patterns are fnmatch patterns over the layer's full dotted name ("output_blocks.*.proj_out");
"out" matches only the top-level layer called out. A YAML override:

    keep: ["*.attn2.to_k", "*.attn2.to_v"]
    quantize: ["time_embed.*"]
    min_params: 0
    convs: false
    gpu_rule: none
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..options.option_text import parse_mapping_text, shorten
from .scheme import QuantizeError, Scheme
from .speed_rule import GemmSpeedRule, gpu_class, rule_for

GPU_RULE_AUTO, GPU_RULE_NONE = "auto", "none"

# family -> [(pattern, reason)]. The family is found from the model's own layer names.
FAMILY_KEEP: dict[str, list[tuple[str, str]]] = {
    "sd_unet": [  # ComfyUI's UNetModel (SD1.x, SD2.x, SDXL)
        ("input_blocks.0.0", "first layer"), ("out.*", "last layer"), ("time_embed.*", "time embedding"),
        ("label_emb.*", "label embedding")],
    "diffusers_unet": [  # diffusers' UNet2DConditionModel
        ("conv_in", "first layer"), ("conv_out", "last layer"), ("time_embedding.*", "time embedding"),
        ("add_embedding.*", "label embedding"), ("class_embedding.*", "label embedding")],
    "flux": [  # ComfyUI's and diffusers' Flux
        ("img_in", "first layer"), ("x_embedder", "first layer"), ("final_layer.*", "last layer"),
        ("proj_out", "last layer"), ("norm_out.*", "output modulation"), ("time_in.*", "time embedding"),
        ("vector_in.*", "text embedding"), ("guidance_in.*", "guidance embedding"),
        ("time_text_embed.*", "time embedding"), ("txt_in", "text embedding"), ("context_embedder", "text embedding")],
    "mmdit": [  # SD3 (ComfyUI's MMDiT, diffusers' SD3Transformer2DModel)
        ("x_embedder.*", "first layer"), ("pos_embed.*", "first layer"), ("final_layer.*", "last layer"),
        ("proj_out", "last layer"), ("norm_out.*", "output modulation"), ("t_embedder.*", "time embedding"),
        ("y_embedder.*", "text embedding"), ("time_text_embed.*", "time embedding"),
        ("context_embedder", "text embedding")],
    "pixart": [  # PixArt-alpha/sigma (ComfyUI's and diffusers' PixArtTransformer2DModel)
        ("x_embedder.*", "first layer"), ("pos_embed.*", "first layer"), ("final_layer.*", "last layer"),
        ("proj_out", "last layer"), ("t_embedder.*", "time embedding"), ("t_block.*", "time embedding"),
        ("adaln_single.*", "time embedding"), ("y_embedder.*", "text embedding"),
        ("caption_projection.*", "text embedding")],
    "generic": [],
}

# A family is recognised by layer names only it has (checked in this order).
_FAMILY_MARKERS = [("sd_unet", "input_blocks"), ("diffusers_unet", "conv_in"), ("flux", "double_blocks"),
                   ("flux", "single_transformer_blocks"), ("pixart", "adaln_single"), ("pixart", "t_block"),
                   ("mmdit", "joint_blocks"), ("mmdit", "context_embedder")]


def detect_family(module: torch.nn.Module) -> str:
    top = {name.split(".")[0] for name, _ in module.named_modules() if name}
    for family, marker in _FAMILY_MARKERS:
        if marker in top:
            return family
    return "generic"


@dataclass(frozen=True)
class LayerPolicy:
    """keep / quantize: extra fnmatch patterns of layer names; min_params: layers with fewer weights
    stay in high precision; convs: quantize Conv2d layers (weight-only); family: "auto" (found from
    the layer names) or a FAMILY_KEEP key; gpu_rule: "auto", "none", a GPU class ("sm_90") or a
    GemmSpeedRule record (speed_rule.py: which layers pay quantized on that GPU)."""

    keep: tuple[str, ...] = ()
    quantize: tuple[str, ...] = ()
    min_params: int = 16384
    convs: bool = True
    family: str = "auto"
    gpu_rule: Union[str, GemmSpeedRule] = GPU_RULE_AUTO

    def __post_init__(self):
        for key in ("keep", "quantize"):  # one pattern alone may be given as text
            patterns = getattr(self, key)
            patterns = (patterns,) if isinstance(patterns, str) else patterns
            if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
                raise QuantizeError(f"layer policy {key} must be a list of name patterns (text), got {shorten(getattr(self, key))}")
            object.__setattr__(self, key, tuple(patterns))
        if not isinstance(self.min_params, int) or isinstance(self.min_params, bool) or self.min_params < 0:
            raise QuantizeError(f"layer policy min_params must be >= 0, a whole number of weights; got {shorten(self.min_params)}")
        if not isinstance(self.convs, bool):
            raise QuantizeError(f"layer policy convs must be true or false, got {shorten(self.convs)}")
        if not isinstance(self.family, str) or (self.family != "auto" and self.family not in FAMILY_KEEP):
            raise QuantizeError(f"layer policy family {shorten(self.family)} is unknown; use auto or one of {', '.join(FAMILY_KEEP)}")
        if not isinstance(self.gpu_rule, GemmSpeedRule) and self.gpu_rule not in (GPU_RULE_AUTO, GPU_RULE_NONE):
            rule_for(self.gpu_rule)  # a GPU class's name, else a QuantizeError naming the field

    def speed_rule(self) -> Optional[GemmSpeedRule]:
        """The rule `gpu_rule` asks for: "auto" the present CUDA GPU's (none on a CPU), "none" none."""
        if isinstance(self.gpu_rule, GemmSpeedRule):
            return self.gpu_rule
        if self.gpu_rule == GPU_RULE_NONE:
            return None
        name = gpu_class() if self.gpu_rule == GPU_RULE_AUTO else self.gpu_rule
        return rule_for(name) if name else None

    def decide(self, name: str, layer: torch.nn.Module, scheme: Scheme, family: str,
               speed: Optional[tuple[GemmSpeedRule, int, str]] = None) -> Optional[str]:
        """None to quantize `layer`, else the reason it stays in high precision. `speed`: (the GPU's rule,
        the rows the layer's GEMM sees at the reference size, which rows), checked last."""
        is_conv = isinstance(layer, torch.nn.Conv2d)
        if is_conv and scheme.comfyui_format:
            return f"convolution (ComfyUI's {scheme.file_format} format has Linear layers only)"
        if _matches(name, self.quantize):
            return None
        if _matches(name, self.keep):
            return "policy keep pattern"
        for pattern, reason in FAMILY_KEEP[family]:
            if fnmatch.fnmatchcase(name, pattern):
                return reason
        if is_conv and not self.convs:
            return "convolution (policy convs: false)"
        if layer.weight.numel() < self.min_params:
            return f"small (< {self.min_params} weights)"
        if speed is not None:
            rule, rows, rows_why = speed
            return rule.keeps(layer, rows, rows_why, weight_only=not scheme.quantizes_activations)
        return None

    def as_dict(self) -> dict:
        rule = self.gpu_rule.as_dict() if isinstance(self.gpu_rule, GemmSpeedRule) else self.gpu_rule
        return {"keep": list(self.keep), "quantize": list(self.quantize), "min_params": self.min_params,
                "convs": self.convs, "family": self.family, "gpu_rule": rule}


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


_FIELDS = tuple(f.name for f in dataclasses.fields(LayerPolicy))


def parse_policy(text: str) -> LayerPolicy:
    """A LayerPolicy from the user's YAML (or JSON) text, read with compiler/options/option_text.py's bounds
    (size, depth, no YAML aliases); "" gives the defaults."""
    return LayerPolicy(**parse_mapping_text(text, "layer policy", _FIELDS, QuantizeError))
