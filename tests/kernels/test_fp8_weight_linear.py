import importlib

import pytest
import torch
from testing_utils import FP32_DOT_TOL, KERNEL_DEVICE, rel_err

from kiln.kernels import fp8_weight_linear, fp8_weight_linear_ref, fp8_weight_linear_triton

pytest.importorskip("triton")
DEVICE = KERNEL_DEVICE  # cpu (interpreted) in CI; cuda with TRITON_INTERPRET=0 on a GPU (sm_89+ for fp8 in Triton)
fp8_module = importlib.import_module("kiln.kernels.quant.fp8_weight_linear")

TOL = {torch.float32: FP32_DOT_TOL, torch.float16: 1e-3, torch.bfloat16: 8e-3}
BF16_DOT_INTERPRETER_BUG = pytest.mark.xfail(DEVICE == "cpu", strict=True,
                                             reason="Triton interpreter: tl.dot on bf16 is wrong")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_INTERPRETER_BUG)]


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax() / 448).clamp_min(1e-12)  # 0-dim, as ComfyUI stores it
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("x_shape", [(37, 45), (2, 3, 45)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_reference(x_shape, dtype, with_bias):
    """The Triton interpreter loads float8_e4m3fn tensors, so the fp8 path runs on CPU too."""
    N = 29
    x = torch.randn(x_shape, device=DEVICE).to(dtype)
    weight, scale = quantize_fp8_per_tensor(torch.randn(N, x_shape[-1], device=DEVICE))
    bias = torch.randn(N, device=DEVICE).to(dtype) if with_bias else None
    out = fp8_weight_linear_triton(x, weight, scale, bias)
    assert out.dtype == dtype and out.shape == (*x_shape[:-1], N)
    assert rel_err(out, fp8_weight_linear_ref(x, weight, scale, bias)) < TOL[dtype]


def test_one_element_scale_is_per_tensor_too():
    x = torch.randn(5, 33, device=DEVICE)
    weight, scale = quantize_fp8_per_tensor(torch.randn(7, 33, device=DEVICE))
    out = fp8_weight_linear_triton(x, weight, scale.reshape(1), None)
    assert rel_err(out, fp8_weight_linear_ref(x, weight, scale, None)) < TOL[torch.float32]


def test_fp8_quantization_error_bound():
    """e4m3 keeps 3 mantissa bits: a stored normal value is within 2^-4 of w / scale relative, a
    subnormal within half the smallest step, 2^-10; times the scale in the weight's units."""
    w = torch.randn(29, 45, dtype=torch.float64)
    weight, scale = quantize_fp8_per_tensor(w)
    err = (weight.double() * scale.double() - w).abs()
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, 2.0 ** -10 * scale.double().expand_as(w)) * (1 + 1e-9)).all()


@pytest.mark.parametrize("device_type, capability, dtype, K, N, triton_ok, path", [
    ("cpu", (0, 0), torch.bfloat16, 64, 64, True, "reference"),
    ("cuda", (9, 0), torch.bfloat16, 3072, 3072, True, "scaled_mm"),
    ("cuda", (8, 9), torch.float32, 320, 1280, False, "scaled_mm"),
    ("cuda", (9, 0), torch.float16, 45, 3072, True, "triton"),      # K not a multiple of 16
    ("cuda", (8, 9), torch.bfloat16, 64, 29, True, "triton"),       # N not a multiple of 16
    ("cuda", (9, 0), torch.float32, 45, 29, True, "dequant"),       # the kernel takes fp16 / bf16
    ("cuda", (9, 0), torch.float16, 45, 29, False, "dequant"),      # no Triton
    ("cuda", (8, 0), torch.float16, 3072, 3072, True, "dequant"),   # A100: no fp8 in cuBLASLt or Triton
])
def test_fp8_path_choice(device_type, capability, dtype, K, N, triton_ok, path):
    assert fp8_module.fp8_path(device_type, capability, dtype, K, N, triton_ok) == path


# opcheck's test_schema compares inputs before and after with torch.allclose, which torch has no CPU
# kernel for on float8_e4m3fn; the schema itself is int8_weight_linear's, which passes test_schema.
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_custom_op_passes_opcheck():
    weight, scale = quantize_fp8_per_tensor(torch.randn(13, 24, device=DEVICE))
    torch.library.opcheck(torch.ops.kiln.fp8_weight_linear.default, (torch.randn(2, 5, 24, device=DEVICE), weight, scale, None),
                          test_utils=FP8_OPCHECKS)
    torch.library.opcheck(torch.ops.kiln.fp8_weight_linear.default,
                          (torch.randn(3, 24, device=DEVICE).half(), weight, scale, torch.randn(13, device=DEVICE).half()),
                          test_utils=FP8_OPCHECKS)


def test_custom_op_under_fullgraph_compile_with_dynamic_rows():
    weight, scale = quantize_fp8_per_tensor(torch.randn(13, 24, device=DEVICE))
    compiled = torch.compile(lambda t: fp8_weight_linear(t, weight, scale, None) + 1, backend="aot_eager", fullgraph=True)
    for rows in (7, 19):
        x = torch.randn(rows, 24, device=DEVICE)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), fp8_weight_linear_ref(x, weight, scale, None) + 1)
