import pytest
import torch
from testing_utils import KERNEL_DEVICE

from kiln.kernels import quantize_per_token, quantize_per_token_ref, quantize_per_token_triton

pytest.importorskip("triton")
DEVICE = KERNEL_DEVICE  # cpu (interpreted) in CI; cuda with TRITON_INTERPRET=0 on a GPU


@pytest.mark.parametrize("shape", [(37, 45), (3, 1031), (1, 7)])  # odd, one past BLOCK_K=1024
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_reference_exactly(shape, dtype):
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    x[0] = 0  # an all-zero row: scale eps, values 0
    q, scale = quantize_per_token_triton(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert q.dtype == torch.int8 and q.shape == shape and scale.dtype == torch.float32 and scale.shape == shape[:1]
    assert torch.equal(scale, scale_ref)  # same fp32 amax / 127 (IEEE division in both)
    assert torch.equal(q, q_ref)          # same rounding: ties to even
    assert scale[0] == 1e-12 and not q[0].any()


def test_rounds_ties_to_even_and_clamps():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0]], device=DEVICE)
    q, scale = quantize_per_token_triton(x)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 126, -127]]
    assert torch.equal(q, quantize_per_token_ref(x)[0])


def test_quantization_error_is_at_most_half_a_step():
    x = torch.randn(37, 45, dtype=torch.float64) * torch.logspace(-3, 3, 37, dtype=torch.float64)[:, None]
    q, scale = quantize_per_token_ref(x)
    err = (q.double() * scale.double()[:, None] - x).abs()
    assert (err <= scale.double()[:, None] * (0.5 + 1e-5)).all()
    assert (q.abs().amax(dim=1) == 127).all()  # each row uses the full range


def test_strided_rows():
    base = torch.randn(9, 50, device=DEVICE)
    x = base[:, :45]  # rows not packed
    q, scale = quantize_per_token_triton(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_custom_op_passes_opcheck():
    torch.library.opcheck(torch.ops.kiln.quantize_per_token.default, (torch.randn(5, 33, device=DEVICE),))
    torch.library.opcheck(torch.ops.kiln.quantize_per_token.default, (torch.randn(3, 8, device=DEVICE).half(),))


def test_custom_op_under_fullgraph_compile_with_dynamic_rows():
    compiled = torch.compile(lambda t: quantize_per_token(t * 2), backend="aot_eager", fullgraph=True)
    for rows in (7, 13):
        x = torch.randn(rows, 24, device=DEVICE)
        torch._dynamo.mark_dynamic(x, 0)
        q, scale = compiled(x)
        q_ref, scale_ref = quantize_per_token_ref(x * 2)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
