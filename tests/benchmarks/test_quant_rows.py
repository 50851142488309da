"""benchmarks/quant_rows.py and quant_profile.py: their arguments, and one tiny CPU run each (the GPU rows and
the kernel table come from a CUDA machine; here the scripts must run and write what they promise)."""
import json

import pytest

from kiln.benchmarks import gpu_suite, quant_profile, quant_rows


def test_rows_are_the_suites_variants_and_name_their_scheme():
    assert set(quant_rows.QUANT_VARIANTS) <= set(gpu_suite.VARIANTS)
    assert quant_rows.QUANT_VARIANTS[0] == "kiln default"
    assert all(("int8" in v or "fp8" in v) for v in quant_rows.TARGET_SCHEMES)


@pytest.mark.parametrize("argv,message", [
    (["--case", "nope", "--variant", "kiln default", "--tiny"], "unknown case 'nope'"),
    (["--case", "sd3-tiny", "--variant", "kiln balanced", "--tiny"], "unknown variant 'kiln balanced'")])
def test_rows_refuse_unknown_names(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        quant_rows.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--case", "sd3-tiny", "--scheme", "int4"], "unknown scheme 'int4'"),
    (["--case", "sd3-tiny", "--scheme", "fp8_e4m3", "--steps", "0"], "--steps must be 1 to 20")])
def test_profile_refuses_bad_arguments(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        quant_profile.main([*argv, "--tiny", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_kernel_names_fall_in_their_groups():
    assert quant_profile.category("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n") == "gemm"
    assert quant_profile.category("triton_red_fused_abs_amax_clamp_div_native_layer_norm_0") == \
        "activation quant / scale reduction"
    assert quant_profile.category("triton_poi_fused__to_copy_add_mul_3") == "epilogue / pointwise"
    assert quant_profile.category("aten::_scaled_mm") == "gemm"
    assert quant_profile.category("void at::native::something") == "other"


@pytest.mark.slow
def test_a_tiny_row_and_its_comparison(tmp_path):
    """One quantized row run for real; its `kiln default` row, which compare() reads beside it, is written
    here (it runs the same code without the quantize step). Its scheme and layer policy are the profile's
    below, so the profile loads this compile from Kiln's cache: the file compiles one quantized model, the
    tiny VAE decoder (its convolutions and its attention's linear layers quantized), cheaper to compile than the
    tiny SD3, since the scripts are what is checked here."""
    assert quant_rows.main(["--tiny", "--case", "vae-decode-tiny", "--variant", "kiln default + fp8_e4m3",
                            "--out", str(tmp_path)]) == 0
    data = json.loads(quant_rows.row_path(tmp_path, "vae-decode-tiny", "kiln default + fp8_e4m3").read_text())
    row = data["row"]
    assert row["ms"] > 0 and row["weight_gb"] > 0 and row["rel_err"] is not None and not row["error"]
    assert data["eager_quant_rel_err"] >= 0 and data["quantized_layers"] > 0 and "Kiln quantize" in data["report"]
    base = dict(row, variant="kiln default", ms=2 * row["ms"], weight_gb=2 * row["weight_gb"])
    quant_rows.row_path(tmp_path, "vae-decode-tiny", "kiln default").write_text(json.dumps({"row": base}))
    (compared,) = quant_rows.compare(tmp_path, "vae-decode-tiny")
    assert compared["variant"] == "kiln default + fp8_e4m3"
    assert compared["speedup_vs_kiln_default"] == 2 and compared["weight_fraction"] == 0.5


@pytest.mark.slow
def test_a_tiny_profile(tmp_path):
    assert quant_profile.main(["--tiny", "--case", "vae-decode-tiny", "--scheme", "fp8_e4m3", "--policy", "min_params: 0",
                               "--steps", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "profile-vae-decode-tiny-fp8_e4m3.json").read_text())
    assert data["quantized_layers"] > 0 and data["kernels"] and data["groups"]
    assert "gemm" in data["groups"] and data["host_syncs_per_step"] == {}  # no .item() in the step
    assert (tmp_path / "profile-vae-decode-tiny-fp8_e4m3.txt").read_text().strip()
