import importlib

import pytest
import torch
import torch.nn.functional as F
from testing_utils import KERNEL_DEVICE

from kiln.kernels import (int8_dynamic_linear, int8_dynamic_linear_ref, int8_dynamic_linear_triton, int8_mm_scaled,
                          int8_mm_scaled_ref, int8_mm_scaled_triton, quantize_per_token_ref)

pytest.importorskip("triton")
DEVICE = KERNEL_DEVICE  # cpu (interpreted) in CI; cuda with TRITON_INTERPRET=0 on a GPU
dynamic_linear = importlib.import_module("kiln.kernels.quant.int8_dynamic_linear")

# The int32 product is exact and the epilogue computes as the reference does; what is left is the
# final cast (the interpreter's fp32 -> bf16 cast truncates: one bf16 step) and, on a GPU, an fma in
# the epilogue.
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (8e-3, 1e-5)}


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("M, K, N", [(37, 45, 29), (5, 160, 17), (1, 3, 2)])
@pytest.mark.parametrize("out_dtype", list(TOL))
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_matches_reference(M, K, N, out_dtype, with_bias):
    xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    wq = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE)
    x_scale, w_scale = torch.rand(M, device=DEVICE) / 100, torch.rand(N, device=DEVICE) / 100
    bias = torch.randn(N, device=DEVICE).to(out_dtype) if with_bias else None
    out = int8_mm_scaled_triton(xq, x_scale, wq, w_scale, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    rtol, atol = TOL[out_dtype]
    torch.testing.assert_close(out, int8_mm_scaled_ref(xq, x_scale, wq, w_scale, bias, out_dtype), rtol=rtol, atol=atol)


@pytest.mark.parametrize("x_shape", [(37, 45), (2, 3, 45)])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_reference(x_shape, dtype, with_bias):
    N = 29
    x = torch.randn(x_shape, device=DEVICE).to(dtype)
    weight, scale = quantize_int8_per_channel(torch.randn(N, x_shape[-1], device=DEVICE))
    bias = torch.randn(N, device=DEVICE).to(dtype) if with_bias else None
    out = int8_dynamic_linear_triton(x, weight, scale, bias)
    assert out.dtype == dtype and out.shape == (*x_shape[:-1], N)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, int8_dynamic_linear_ref(x, weight, scale, bias), rtol=rtol, atol=atol)


def test_int32_mm_is_exact_on_every_path():
    a = torch.randint(-127, 128, (37, 45), dtype=torch.int8)
    b = torch.randint(-127, 128, (29, 45), dtype=torch.int8)
    exact = a.long() @ b.long().t()
    assert torch.equal(dynamic_linear.int32_mm(a, b).long(), exact)          # torch._int_mm (CPU: any shape)
    assert torch.equal((a.double() @ b.double().t()).long(), exact)          # the fp64 fallback
    assert dynamic_linear.int32_mm(a[:0], b).shape == (0, 29)


def test_w8a8_error_bound_against_float_math():
    """With int8 weights fixed, quantizing x per token moves each x_k by at most x_scale/2, so each
    output moves by at most x_scale_m / 2 * sum_k |w_deq[n, k]|."""
    x = torch.randn(37, 45, dtype=torch.float64) * torch.logspace(-2, 2, 37, dtype=torch.float64)[:, None]
    weight, scale = quantize_int8_per_channel(torch.randn(29, 45))
    w_deq = weight.double() * scale.double()[:, None]
    out = int8_dynamic_linear_ref(x.float(), weight, scale, None).double()
    _, x_scale = quantize_per_token_ref(x)
    bound = x_scale.double()[:, None] / 2 * w_deq.abs().sum(dim=1)[None, :]
    assert ((out - F.linear(x, w_deq)).abs() <= bound * (1 + 1e-4) + 1e-5).all()


def test_custom_ops_pass_opcheck():
    weight, scale = quantize_int8_per_channel(torch.randn(13, 24, device=DEVICE))
    bias = torch.randn(13, device=DEVICE)
    torch.library.opcheck(torch.ops.kiln.int8_dynamic_linear.default, (torch.randn(2, 5, 24, device=DEVICE), weight, scale, bias))
    torch.library.opcheck(torch.ops.kiln.int8_dynamic_linear.default, (torch.randn(3, 24, device=DEVICE).half(), weight, scale, None))
    xq, x_scale = quantize_per_token_ref(torch.randn(5, 24, device=DEVICE))
    torch.library.opcheck(torch.ops.kiln.int8_mm_scaled.default, (xq, x_scale, weight, scale, bias, torch.float16))


def test_custom_ops_under_fullgraph_compile_with_dynamic_rows():
    weight, scale = quantize_int8_per_channel(torch.randn(13, 24, device=DEVICE))
    bias = torch.randn(13, device=DEVICE)
    linear = torch.compile(lambda t: int8_dynamic_linear(t, weight, scale, bias) * 2, backend="aot_eager", fullgraph=True)
    gemm = torch.compile(lambda q, s: int8_mm_scaled(q, s, weight, scale, None, torch.bfloat16), backend="aot_eager",
                         fullgraph=True)
    for rows in (7, 19):
        x = torch.randn(2, rows, 24, device=DEVICE)
        torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(linear(x), int8_dynamic_linear_ref(x, weight, scale, bias) * 2)
        xq, x_scale = quantize_per_token_ref(x[0])
        torch._dynamo.mark_dynamic(xq, 0)
        torch._dynamo.mark_dynamic(x_scale, 0)
        torch.testing.assert_close(gemm(xq, x_scale), int8_mm_scaled_ref(xq, x_scale, weight, scale, None, torch.bfloat16))
