import pytest
import torch
from testing_utils import KERNEL_DEVICE

from kiln.kernels import group_norm_silu, group_norm_silu_ref, group_norm_silu_triton

pytest.importorskip("triton")
DEVICE = KERNEL_DEVICE  # cpu (interpreted) in CI; cuda with TRITON_INTERPRET=0 on a GPU

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
SHAPES = [((2, 12, 5, 7), 3), ((1, 30, 9, 11), 5), ((2, 6, 17), 2), ((1, 8, 3, 4, 5), 4)]


@pytest.mark.parametrize("shape, groups", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("affine, silu", [(True, True), (False, True), (True, False)])
def test_triton_matches_reference(shape, groups, dtype, channels_last, affine, silu):
    x = (torch.randn(shape, device=DEVICE) * 3 + 2).to(dtype)  # an offset mean: catches E[x^2]-E[x]^2 cancellation
    if channels_last and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    w, b = (torch.randn(shape[1], device=DEVICE).to(dtype), torch.randn(shape[1], device=DEVICE).to(dtype)) if affine else (None, None)
    out = group_norm_silu_triton(x, groups, w, b, 1e-5, silu)
    ref = group_norm_silu_ref(x.float(), groups, None if w is None else w.float(), None if b is None else b.float(), 1e-5, silu)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.stride() == x.stride()  # same memory format as the input
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_non_dense_input_is_made_contiguous():
    x = torch.randn(2, 12, 9, 14, device=DEVICE)[..., ::2]
    torch.testing.assert_close(group_norm_silu_triton(x, 3), group_norm_silu_ref(x, 3), atol=1e-5, rtol=1e-5)


def test_reference_keeps_channels_last():
    x = torch.randn(2, 6, 5, 5, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert group_norm_silu_ref(x, 3).is_contiguous(memory_format=torch.channels_last)


def test_custom_op_passes_opcheck():
    x, w, b = torch.randn(2, 6, 5, 7, device=DEVICE), torch.randn(6, device=DEVICE), torch.randn(6, device=DEVICE)
    torch.library.opcheck(torch.ops.kiln.group_norm_silu.default, (x, 3, w, b, 1e-5, True))
    torch.library.opcheck(torch.ops.kiln.group_norm_silu.default, (x, 2, None, None, 1e-6, False))


def test_custom_op_under_fullgraph_compile():
    x, w, b = torch.randn(2, 6, 5, 7, device=DEVICE), torch.randn(6, device=DEVICE), torch.randn(6, device=DEVICE)
    compiled = torch.compile(lambda t: group_norm_silu(t, 3, w, b, 1e-5) + 1, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), group_norm_silu_ref(x, 3, w, b, 1e-5) + 1)
