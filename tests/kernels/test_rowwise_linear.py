"""kernels/quant/rowwise_linear.py: the traceable W8A8 Linear. Its numerics against the float64 reference,
its rowwise scale shapes, the CUDA GEMM calls' operand layouts (checked on meta tensors, where torch's
own shape checks for _scaled_mm and _int_mm run), and QuantLinear traced whole with no host sync."""
import pytest
import torch

from kiln.compiler.quantize import SCHEMES, QuantLinear
from kiln.kernels.quant import INT8_MAX, FP8_MAX, quantize_per_token_ref
from kiln.kernels.quant.int8_dynamic_linear import int8_dynamic_linear_ref
from kiln.kernels.quant.rowwise_linear import (ROWWISE_OUT_DTYPE, _scaled_mm_rowwise, gemm_for, quantize_rows,
                                               rowwise_linear, rowwise_linear_ref)

STORAGES = [torch.int8, torch.float8_e4m3fn]
# the fp32 paths against the float64 reference of the same math: rounding of an fp32 K-sum (int8's is exact
# in int32, then one fp32 product per scale)
SAME_MATH_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# quantized against the float Linear: int8 rows lose ~1/254 of their range, e4m3 keeps 3 mantissa bits
QUANT_TOL = {torch.int8: 0.02, torch.float8_e4m3fn: 0.06}


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def stored(storage, N, K, per_channel):
    w = torch.randn(N, K)
    qmax = INT8_MAX if storage == torch.int8 else FP8_MAX
    scale = (w.abs().amax(dim=1) if per_channel else w.abs().amax()) / qmax
    scaled = w / (scale[:, None] if per_channel else scale)
    q = scaled.round().clamp(-qmax, qmax).to(storage) if storage == torch.int8 else scaled.to(storage)
    return w, q, scale


@pytest.mark.parametrize("storage", STORAGES)
def test_rows_get_one_scale_each_shaped_m_by_1(storage):
    x = torch.randn(37, 45)
    x[3] = 0  # an all-zero row: scale EPS, values 0
    xq, scale = quantize_rows(x, storage)
    assert xq.shape == (37, 45) and xq.dtype == storage
    assert scale.shape == (37, 1) and scale.dtype == torch.float32
    qmax = INT8_MAX if storage == torch.int8 else FP8_MAX
    torch.testing.assert_close(scale[:, 0][torch.arange(37) != 3], x.abs().amax(dim=1)[torch.arange(37) != 3] / qmax)
    assert (xq[3].float() == 0).all()
    assert xq.float().abs().max() <= qmax


def test_int8_rows_are_the_per_token_kernels_rows():
    x = torch.randn(19, 70)
    xq, scale = quantize_rows(x, torch.int8)
    ref_q, ref_scale = quantize_per_token_ref(x)
    assert torch.equal(xq, ref_q) and torch.equal(scale[:, 0], ref_scale)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape", [(37, 48), (2, 5, 48)])
def test_cpu_path_is_the_reference_math(storage, per_channel, dtype, x_shape):
    N = 40
    w, q, scale = stored(storage, N, x_shape[-1], per_channel)
    x = torch.randn(x_shape).to(dtype)
    bias = torch.randn(N).to(dtype)
    scale_b = scale.reshape(-1).expand(N).reshape(1, N).contiguous()
    gemm = gemm_for(storage, torch.device("cpu"), x_shape[-1], N)
    out = rowwise_linear(x, q.t(), scale_b, bias, gemm)
    assert out.shape == (*x_shape[:-1], N) and out.dtype == dtype
    assert rel_err(out, rowwise_linear_ref(x, q, scale, bias)) < SAME_MATH_TOL[dtype]
    float_out = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert rel_err(out, float_out) < QUANT_TOL[storage]


def test_int8_path_is_bit_for_bit_the_int8_dynamic_op_reference():
    w, q, scale = stored(torch.int8, 24, 32, True)
    x, bias = torch.randn(3, 11, 32), torch.randn(24)
    out = rowwise_linear(x, q.t(), scale.reshape(1, 24), bias, "int_mm")
    assert torch.equal(out, int8_dynamic_linear_ref(x, q, scale, bias))


def test_the_fallback_matmul_for_few_rows_is_the_same_math():
    w, q, scale = stored(torch.int8, 24, 32, True)
    x = torch.randn(4, 32)
    assert rel_err(rowwise_linear(x, q.t(), scale.reshape(1, 24), None, "reference"),
                   rowwise_linear(x, q.t(), scale.reshape(1, 24), None, "int_mm")) < SAME_MATH_TOL[torch.float32]


def test_gemm_choice_on_the_cpu():
    cpu = torch.device("cpu")
    assert gemm_for(torch.int8, cpu, 33, 7) == "int_mm"  # the CPU's _int_mm takes any shape
    assert gemm_for(torch.float8_e4m3fn, cpu, 33, 7) == "reference"


@pytest.mark.parametrize("dtype,bias_fused", [(torch.bfloat16, True), (torch.float16, False)])
def test_scaled_mm_call_passes_torchs_own_layout_checks(dtype, bias_fused):
    """On meta tensors torch checks _scaled_mm's operands as on CUDA (row-major x, column-major weight,
    K and N multiples of 16): the layer's weight.t() and its (M, 1) / (1, N) scales pass."""
    M, K, N = 64, 96, 48
    x = torch.empty(M, K, device="meta", dtype=dtype)
    xq, scale_a = quantize_rows(x, torch.float8_e4m3fn)
    weight = torch.empty(N, K, device="meta", dtype=torch.float8_e4m3fn)
    out = _scaled_mm_rowwise(xq, weight.t(), scale_a, torch.empty(1, N, device="meta"),
                             torch.empty(N, device="meta", dtype=dtype), dtype)
    assert out.shape == (M, N) and out.dtype == dtype and ROWWISE_OUT_DTYPE == torch.bfloat16
    with pytest.raises(RuntimeError, match="col_major"):  # a weight made contiguous after .t() is refused
        _scaled_mm_rowwise(xq, weight.t().contiguous(), scale_a, torch.empty(1, N, device="meta"), None, dtype)


def test_int_mm_call_shapes_on_meta():
    xq = torch.empty(64, 96, device="meta", dtype=torch.int8)
    weight = torch.empty(48, 96, device="meta", dtype=torch.int8)
    assert torch._int_mm(xq, weight.t()).shape == (64, 48)


# ---- the layer, traced ---------------------------------------------------------------------------------

def aten_graphs(fn, *args):
    """(TorchDynamo graph count, the ATen graphs AOTAutograd makes of them) for fn compiled fullgraph."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep), fullgraph=True, dynamic=True)
    with torch.no_grad():
        out = compiled(*args)
    return out, graphs


@pytest.mark.parametrize("scheme", ["int8_dynamic", "fp8_e4m3"])
def test_quant_linear_traces_whole_with_no_host_sync_and_no_custom_op(scheme):
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48)
    layer = QuantLinear.from_float(dense, SCHEMES[scheme])
    assert layer.gemm is not None and layer.scale_b.shape == (1, 48) and layer.scale_b.dtype == torch.float32
    norm = torch.nn.LayerNorm(64)

    def block(x):
        return layer(norm(x)).relu()

    x = torch.randn(2, 9, 64)
    out, graphs = aten_graphs(block, x)
    with torch.no_grad():
        torch.testing.assert_close(out, block(x))
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert not any("_local_scalar_dense" in t for t in targets), targets
    assert not any(t.startswith("kiln.") for t in targets), targets
    assert any("amax" in t for t in targets)  # the row amax is in the graph, where Inductor can fuse it


def test_the_scales_stay_fp32_and_the_gemm_is_kept_across_a_dtype_cast():
    layer = QuantLinear.from_float(torch.nn.Linear(32, 16), SCHEMES["fp8_e4m3"])
    layer.to(torch.bfloat16)
    assert layer.scale_b.dtype == torch.float32 and layer.weight_scale.dtype == torch.float32
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.bias.dtype == torch.bfloat16
    assert layer.gemm == "reference"
    assert "scale_b" not in layer.state_dict()  # derived at load, never saved
    out = layer(torch.randn(5, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_scale_b_follows_a_loaded_weight_scale():
    layer = QuantLinear.from_float(torch.nn.Linear(32, 16), SCHEMES["int8_dynamic"])
    state = layer.state_dict()
    state["weight_scale"] = state["weight_scale"] * 2
    layer.load_state_dict(state)
    torch.testing.assert_close(layer.scale_b, state["weight_scale"].reshape(1, 16))


def test_weight_only_schemes_keep_their_kernel_op():
    layer = QuantLinear.from_float(torch.nn.Linear(32, 16), SCHEMES["int8_weight"])
    assert layer.gemm is None and not hasattr(layer, "scale_b")
