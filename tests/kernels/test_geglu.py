import pytest
import torch
from testing_utils import KERNEL_DEVICE

from kiln.kernels import geglu, geglu_ref, geglu_triton

pytest.importorskip("triton")
DEVICE = KERNEL_DEVICE  # cpu (interpreted) in CI; cuda with TRITON_INTERPRET=0 on a GPU

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("shape", [(3, 7, 2 * 45), (1, 5, 2 * 33), (2, 2 * 1031)])  # odd, one past a block
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_triton_matches_reference(shape, dtype, approximate):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    atol, rtol = TOL[dtype]
    out = geglu_triton(x, approximate)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out.float(), geglu_ref(x.float(), approximate), atol=atol, rtol=rtol)


def test_strided_rows():
    base = torch.randn(4, 9, 2 * 17 + 5, device=DEVICE)
    x = base[..., : 2 * 17]  # rows not packed: last dim unit-stride, row stride 39
    torch.testing.assert_close(geglu_triton(x), geglu_ref(x), atol=1e-5, rtol=1e-5)


def test_custom_op_passes_opcheck():
    torch.library.opcheck(torch.ops.kiln.geglu.default, (torch.randn(3, 5, 22, device=DEVICE), "none"))
    torch.library.opcheck(torch.ops.kiln.geglu.default, (torch.randn(2, 10, device=DEVICE), "tanh"))


def test_custom_op_under_fullgraph_compile():
    x = torch.randn(3, 7, 18, device=DEVICE)
    compiled = torch.compile(lambda t: geglu(t) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), geglu_ref(x) * 2)
