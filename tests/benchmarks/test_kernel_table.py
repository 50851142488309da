"""benchmarks/kernel_table.py profiles a GPU; here its grouping by kernel class, its table and its argument checks."""
import pytest

from kiln.benchmarks import kernel_table
from kiln.benchmarks.kernel_table import OTHER, by_class, classes_table, kernel_class


@pytest.mark.parametrize("name, label", [
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "matmul"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTT", "matmul"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__half>", "copy and layout"),
    ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x256x64", "convolution"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "attention"),
    ("_geglu_kernel", "kiln kernel"),
    ("_group_stats_kernel", "kiln kernel"),
    ("_group_apply_kernel", "kiln kernel"),
    ("triton_red_fused_native_group_norm_silu_0", "inductor triton"),
    ("triton_poi_fused_add_mul_3", "inductor triton"),
    ("void at::native::(anonymous namespace)::GroupNormKernel", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy and layout"),
    ("some_unknown_kernel", OTHER),
])
def test_a_kernel_is_classed_by_its_name(name, label):
    assert kernel_class(name) == label


def test_kernels_add_up_by_class_in_order_of_time():
    kernels = [{"name": "triton_poi_fused_add_0", "ms": 0.5, "calls": 2}, {"name": "nvjet_x", "ms": 3.0, "calls": 4},
               {"name": "triton_red_fused_1", "ms": 0.25, "calls": 1}]
    assert by_class(kernels) == {"matmul": {"ms": 3.0, "calls": 4}, "inductor triton": {"ms": 0.75, "calls": 3}}


def test_the_table_sets_the_variants_side_by_side_with_the_first_ones_difference():
    runs = {"kiln balanced whole": {"busy_ms": 3.5, "launches": 7, "classes": {"matmul": {"ms": 3.0, "calls": 4},
                                                                               "kiln kernel": {"ms": 0.5, "calls": 3}}},
            "torch.compile": {"busy_ms": 3.25, "launches": 6, "classes": {"matmul": {"ms": 2.75, "calls": 4},
                                                                          "inductor triton": {"ms": 0.5, "calls": 2}}},
            "broken": {"error": "RuntimeError: x"}}
    lines = classes_table(runs).splitlines()
    assert lines[0] == ("| kernel class | kiln balanced whole ms | kiln balanced whole calls | torch.compile ms | "
                        "torch.compile calls | broken ms | broken calls | kiln balanced whole - torch.compile ms | "
                        "kiln balanced whole - broken ms |")
    assert lines[2] == "| matmul | 3.000 | 4 | 2.750 | 4 | - | - | +0.250 | +3.000 |"
    assert "| kiln kernel | 0.500 | 3 | - | - | - | - | +0.500 | +0.500 |" in lines
    assert "| inductor triton | - | - | 0.500 | 2 | - | - | -0.500 | +0.000 |" in lines
    assert lines[-1] == "| **GPU busy, all kernels** | 3.500 | 7 | 3.250 | 6 | - | - | +0.250 | - |"


@pytest.mark.parametrize("argv, message", [
    (["--case", "sd99"], "--case: use one of sd15-512-cfg"),
    (["--case", "sdxl-1024-cfg", "--variants", "kiln turbo"], "--variants: kiln turbo; the GPU suite's variants are"),
    (["--case", "sdxl-1024-cfg", "--reps", "0"], "--reps: a whole number from 1 to 100"),
    (["--case", "sdxl-1024-cfg"], "no CUDA device"),
])
def test_wrong_arguments_are_refused(argv, message, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        kernel_table.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
