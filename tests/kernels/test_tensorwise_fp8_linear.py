"""kernels/quant/tensorwise_fp8_linear.py: ComfyUI's fp8 layers' math (static per-tensor activation scale),
traceable: against a float64 recompute, the torch._scaled_mm call's layouts on meta tensors, traced whole."""
import pytest
import torch

from kiln.kernels.quant import FP8_MAX, tensorwise_fp8_linear

SAME_MATH_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def comfy_math(x, weight, weight_scale, input_scale, bias):
    """ComfyUI 0.33 + comfy_kitchen, in float64: x * (1 / input_scale) in x's dtype, clamped, cast to e4m3;
    (xq @ w.T) * input_scale * weight_scale + bias."""
    s = torch.ones(()) if input_scale is None else input_scale
    xq = (x * (1.0 / s).to(x.dtype)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = (xq.double() @ weight.double().t()) * s.double() * weight_scale.double()
    return (out + bias.double()) if bias is not None else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("input_scale", [None, 0.05])
def test_cpu_path_is_comfyuis_math(dtype, input_scale):
    torch.manual_seed(0)
    w = torch.randn(24, 40)
    weight_scale = w.abs().amax() / FP8_MAX
    weight = (w / weight_scale).to(torch.float8_e4m3fn)
    x = torch.randn(3, 7, 40).to(dtype)
    bias = torch.randn(24).to(dtype)
    scale = None if input_scale is None else torch.tensor(input_scale)
    out = tensorwise_fp8_linear(x, weight, weight_scale, scale, bias)
    assert out.shape == (3, 7, 24) and out.dtype == dtype
    assert rel_err(out, comfy_math(x, weight, weight_scale, scale, bias)) < SAME_MATH_TOL[dtype]


def test_scaled_mm_call_passes_torchs_layout_checks_on_meta():
    x = torch.empty(64, 96, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(48, 96, device="meta", dtype=torch.float8_e4m3fn)
    out = tensorwise_fp8_linear(x, weight, torch.empty((), device="meta"), torch.empty((), device="meta"),
                                torch.empty(48, device="meta", dtype=torch.bfloat16), use_scaled_mm=True)
    assert out.shape == (64, 48) and out.dtype == torch.bfloat16


def test_traced_whole_without_host_sync():
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    weight = torch.randn(24, 32).to(torch.float8_e4m3fn)
    fn = torch.compile(lambda x: tensorwise_fp8_linear(x, weight, torch.tensor(0.01), None, None),
                       backend=aot_autograd(fw_compiler=keep), fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    with torch.no_grad():
        fn(torch.randn(5, 32))
    assert len(graphs) == 1
    assert not any("_local_scalar_dense" in str(n.target) for n in graphs[0].graph.nodes)
