"""GPU only: the quantized layers' GEMMs on a CUDA machine (CI has no GPU and skips these):

    TRITON_INTERPRET=0 python -m pytest tests/gpu/test_quant_gemms.py -q

What the CPU tests cannot show: on CUDA the W8A8 layers pick torch._scaled_mm (sm_89+) / torch._int_mm, agree
with the float64 reference of the same math, compile under Inductor into one graph with no host sync, and the
GPU speed rule is the card's class; ComfyUI's fp8 layout math runs torch._scaled_mm with per-tensor scales.
"""
import os

import pytest
import torch

from kiln.compiler.quantize import SCHEMES, LayerPolicy, QuantLinear, gpu_class
from kiln.kernels.quant import rowwise_linear_ref, tensorwise_fp8_linear
from kiln.kernels.quant.rowwise_linear import FP8_MIN_CAPABILITY

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU with TRITON_INTERPRET=0 (see this file's docstring)")

# the GPU's GEMMs against the float64 reference of the same quantized math: bf16 output rounding, fast accum
SAME_MATH_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 1.5e-2}


def fp8_capable() -> bool:
    return torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("scheme", ["int8_dynamic", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_layers_pick_the_gemm_and_match_the_reference(scheme, dtype):
    if scheme == "fp8_e4m3" and not fp8_capable():
        pytest.skip("no fp8 tensor cores (sm_89+)")
    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 768).to("cuda", dtype)
    layer = QuantLinear.from_float(dense, SCHEMES[scheme], out_device="cuda")
    assert layer.gemm == ("scaled_mm" if scheme == "fp8_e4m3" else "int_mm")
    x = torch.randn(2, 300, 1024, device="cuda", dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
        ref = rowwise_linear_ref(x, layer.weight, layer.weight_scale, layer.bias)
    assert out.dtype == dtype and rel_err(out, ref) < SAME_MATH_TOL[dtype]


@pytest.mark.parametrize("scheme", ["int8_dynamic", "fp8_e4m3"])
def test_inductor_compiles_the_layer_in_one_graph_without_host_sync(scheme):
    if scheme == "fp8_e4m3" and not fp8_capable():
        pytest.skip("no fp8 tensor cores (sm_89+)")
    torch._dynamo.reset()
    norm = torch.nn.LayerNorm(1024).to("cuda", torch.bfloat16)
    layer = QuantLinear.from_float(torch.nn.Linear(1024, 1024).to("cuda", torch.bfloat16), SCHEMES[scheme],
                                   out_device="cuda")
    block = torch.compile(lambda x: layer(norm(x)), fullgraph=True, dynamic=True)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), layer(norm(x)), atol=0.1, rtol=0.05)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            block(x)
    names = {evt.key for evt in prof.key_averages()}
    assert not names & {"aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize"}, names


def test_comfyuis_fp8_layout_runs_scaled_mm():
    if not fp8_capable():
        pytest.skip("no fp8 tensor cores (sm_89+)")
    w = torch.randn(768, 1024, device="cuda")
    scale = w.abs().amax() / 448
    weight = (w / scale).to(torch.float8_e4m3fn)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    fast = tensorwise_fp8_linear(x, weight, scale, None, None)
    ref = tensorwise_fp8_linear(x, weight, scale, None, None, use_scaled_mm=False)
    assert rel_err(fast, ref) < SAME_MATH_TOL[torch.bfloat16]


def test_the_default_policy_applies_this_cards_rule():
    assert LayerPolicy().speed_rule().gpu_class == gpu_class()
