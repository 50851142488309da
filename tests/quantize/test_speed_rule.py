"""The GPU speed rule (compiler/quantize/speed_rule.py): which layers stay in high precision on a GPU class,
decided by a size rule whose constants are a typed per-class record (injected here), and said in the report."""
import dataclasses

import pytest
import torch

from kiln.compiler.quantize import (SCHEMES, SPEED_RULES, GemmSpeedRule, LayerPolicy, QuantizeError, parse_policy,
                                    quantize, rows_at_reference, rule_for)
from kiln.compiler.quantize.speed_rule import IMAGE_ROWS, SAMPLE_ROWS, TEXT_ROWS, unet_levels
from kiln.testing.models import MODELS

RULE = GemmSpeedRule("sm_test", min_macs=10_000_000, align=16, weight_only_max_rows=256)


class Block(torch.nn.Module):
    """Layers named as a Flux block's: a modulation that feeds a norm, an image projection, an odd one."""

    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.Module()
        self.norm1.linear = torch.nn.Linear(64, 192)   # per-sample rows: feeds a norm
        self.to_q = torch.nn.Linear(64, 64)              # 4096 x 64 x 64 = 16.8M MACs: quantized
        self.small = torch.nn.Linear(16, 32)             # 4096 x 32 x 16 = 2.1M MACs: small
        self.odd = torch.nn.Linear(72, 100)              # N 100 not a multiple of 16


class Flux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.double_blocks = torch.nn.ModuleList([Block()])


def kept(model, scheme="fp8_e4m3", rule=RULE):
    q = quantize(model, scheme, policy=LayerPolicy(min_params=0, gpu_rule=rule))
    report = q.kiln_quant_report
    return {name: reason for reason, names in report.kept.items() for name in names}, report


def test_each_reason_is_said_per_layer():
    reasons, report = kept(Flux())
    assert reasons["double_blocks.0.norm1.linear"] == "sm_test: feeds a norm (per-sample modulation, 1 rows)"
    assert reasons["double_blocks.0.small"].startswith("sm_test: small GEMM (4096 image rows x 32 x 16 < 1e+07 MACs)")
    assert reasons["double_blocks.0.odd"] == "sm_test: odd shape (N 100, K 72 not multiples of 16)"
    assert report.quantized == ["double_blocks.0.to_q"]
    assert any(note.startswith("GPU rule sm_test") for note in report.notes)
    assert report.policy["gpu_rule"]["min_macs"] == 10_000_000  # the record, as used, in the report


def test_the_constants_decide_a_recalibrated_record_quantizes_the_small_layer():
    recalibrated = dataclasses.replace(RULE, min_macs=1_000_000)
    reasons, report = kept(Flux(), rule=recalibrated)
    assert "double_blocks.0.small" in report.quantized and "double_blocks.0.small" not in reasons


def test_weight_only_schemes_keep_compute_bound_gemms():
    reasons, _ = kept(Flux(), scheme="int8_weight")
    assert reasons["double_blocks.0.to_q"] == ("sm_test: weight-only GEMM at 4096 image rows is compute-bound "
                                               "(> 256 rows)")


def test_convolutions_stay_unless_the_class_says_they_pay():
    unet = MODELS["sd15"].build("tiny")
    reasons, _ = kept(unet, scheme="int8_dynamic", rule=dataclasses.replace(RULE, min_macs=0))
    assert reasons["down_blocks.0.resnets.0.conv1"] == "sm_test: convolution (weight-only, dequantized per call)"
    reasons, _ = kept(unet, scheme="int8_dynamic", rule=dataclasses.replace(RULE, min_macs=0, convs=True))
    assert "down_blocks.0.resnets.0.conv1" not in reasons


def test_unet_rows_shrink_per_level_and_text_and_time_layers_are_told_apart():
    unet = MODELS["sd15"].build("tiny")
    levels = unet_levels(unet)
    deepest = len(unet.down_blocks) - 1
    assert levels["down_blocks.0."] == 0 and levels["mid_block."] == deepest and levels["up_blocks.0."] == deepest
    rows = rows_at_reference(unet, "diffusers_unet")
    assert rows["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"] == (2 * 64 * 64, IMAGE_ROWS)
    assert rows["mid_block.attentions.0.transformer_blocks.0.attn1.to_q"] == (2 * 64 * 64 // 4 ** deepest, IMAGE_ROWS)
    assert rows["up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"] == (2 * 64 * 64 // 4 ** (deepest - 1),
                                                                                IMAGE_ROWS)
    assert rows["down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"] == (2 * 77, TEXT_ROWS)
    assert rows["down_blocks.0.resnets.0.time_emb_proj"] == (2, SAMPLE_ROWS)


def test_sdxl_is_estimated_at_its_own_reference_size():
    rows = rows_at_reference(MODELS["sdxl"].build("tiny"), "diffusers_unet")
    assert rows["down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"] == (2 * 64 * 64, IMAGE_ROWS)


def test_the_cpu_default_applies_no_rule_and_names_ask_for_a_class():
    assert LayerPolicy().gpu_rule == "auto"
    if not torch.cuda.is_available():
        assert LayerPolicy().speed_rule() is None  # existing CPU behaviour unchanged
    assert parse_policy("gpu_rule: sm_90").speed_rule() == SPEED_RULES["sm_90"]
    assert parse_policy("gpu_rule: none").speed_rule() is None
    unknown = rule_for("sm_120")
    assert unknown.gpu_class == "sm_120" and unknown.min_macs == GemmSpeedRule("x", min_macs=2 ** 31).min_macs
    with pytest.raises(QuantizeError, match="gpu_rule 'fast' is not a GPU class"):
        parse_policy("gpu_rule: fast")
    with pytest.raises(QuantizeError, match="min_macs must be a whole number"):
        GemmSpeedRule("sm_90", min_macs=-1)


def test_forced_layers_pass_over_the_rule():
    q = quantize(Flux(), "fp8_e4m3", policy=LayerPolicy(min_params=0, gpu_rule=RULE, quantize=("*.small",)))
    assert "double_blocks.0.small" in q.kiln_quant_report.quantized


def test_sd15_at_its_reference_size_keeps_its_attention_projections_on_an_h100_class():
    """The shipped sm_90 constants on SD1.5's real widths (320/640/1280, meta tensors: no memory): the
    attention projections' GEMMs (8192 x 320 x 320 = 0.84 GMACs) stay, the feed-forward ones go in."""
    rule = SPEED_RULES["sm_90"]
    proj = torch.nn.Linear(320, 320, device="meta")
    ff = torch.nn.Linear(320, 2560, device="meta")
    assert rule.keeps(proj, 8192, IMAGE_ROWS, weight_only=False).startswith("sm_90: small GEMM")
    assert rule.keeps(ff, 8192, IMAGE_ROWS, weight_only=False) is None
    assert SCHEMES["fp8_e4m3"].quantizes_activations and not SCHEMES["int8_weight"].quantizes_activations
