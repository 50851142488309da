import pytest
import torch
from testing_utils import KERNEL_DEVICE

from kiln.kernels import layer_norm_modulate, layer_norm_modulate_ref, layer_norm_modulate_triton
from kiln.kernels.layer_norm_modulate import per_sample_channel

pytest.importorskip("triton")
DEVICE = KERNEL_DEVICE  # cpu (interpreted) in CI; cuda with TRITON_INTERPRET=0 on a GPU

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
# (x shape, scale/shift shape): DiT tokens with per-sample modulation, one sample's modulation
# broadcast over the batch, 2-D rows, a 4-D input; channel counts odd and one past a power of two
SHAPES = [((2, 37, 45), (2, 1, 45)), ((3, 11, 129), (1, 1, 129)), ((5, 33), (5, 33)), ((2, 3, 5, 17), (2, 1, 1, 17))]


def _inputs(x_shape, mod_shape, dtype, affine):
    x = (torch.randn(x_shape, device=DEVICE) * 3 + 2).to(dtype)  # an offset mean: catches E[x^2]-E[x]^2 cancellation
    scale = (1 + 0.5 * torch.randn(mod_shape, device=DEVICE)).to(dtype)
    shift = torch.randn(mod_shape, device=DEVICE).to(dtype)
    c = x_shape[-1]
    w, b = (torch.randn(c, device=DEVICE).to(dtype), torch.randn(c, device=DEVICE).to(dtype)) if affine else (None, None)
    return x, w, b, scale, shift


def _f32(t):
    return None if t is None else t.float()


@pytest.mark.parametrize("x_shape, mod_shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("affine", [False, True])
def test_triton_matches_reference(x_shape, mod_shape, dtype, affine):
    x, w, b, scale, shift = _inputs(x_shape, mod_shape, dtype, affine)
    out = layer_norm_modulate_triton(x, w, b, 1e-6, scale, shift)
    ref = layer_norm_modulate_ref(x.float(), _f32(w), _f32(b), 1e-6, scale.float(), shift.float())
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_eager_type_promotion_is_kept():
    """bf16 activations modulated by fp32 scale/shift give fp32, as in eager."""
    x, _, _, scale, shift = _inputs((2, 9, 24), (2, 1, 24), torch.bfloat16, False)
    out = layer_norm_modulate_triton(x, None, None, 1e-6, scale.float(), shift.float())
    ref = layer_norm_modulate_ref(x, None, None, 1e-6, scale.float(), shift.float())
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_non_contiguous_input_and_strided_modulation():
    x = torch.randn(2, 45, 13, device=DEVICE).transpose(1, 2)   # (2, 13, 45), not contiguous
    mods = torch.randn(2, 1, 2 * 45, device=DEVICE)
    scale, shift = mods[..., :45], mods[..., 45:]               # views with a row stride of 90
    out = layer_norm_modulate_triton(x, None, None, 1e-5, scale, shift)
    torch.testing.assert_close(out, layer_norm_modulate_ref(x, None, None, 1e-5, scale, shift), atol=1e-5, rtol=1e-5)


def test_per_sample_channel_accepts_only_per_sample_channel_modulation():
    x = torch.empty(2, 7, 5)
    assert per_sample_channel(torch.empty(2, 1, 5), x).shape == (2, 5)
    assert per_sample_channel(torch.empty(5), x).stride() == (0, 1)
    assert per_sample_channel(torch.empty(2, 1, 1), x).stride()[1] == 0
    assert per_sample_channel(torch.empty(2, 7, 5), x) is None       # per token: not AdaLN
    assert per_sample_channel(torch.empty(3, 1, 5), x) is None       # another batch
    assert per_sample_channel(torch.empty(1, 2, 1, 5), x) is None    # more dims than x


def test_custom_op_passes_opcheck():
    x, w, b, scale, shift = _inputs((2, 5, 19), (2, 1, 19), torch.float32, True)
    torch.library.opcheck(torch.ops.kiln.layer_norm_modulate.default, (x, w, b, 1e-6, scale, shift))
    torch.library.opcheck(torch.ops.kiln.layer_norm_modulate.default, (x, None, None, 1e-6, scale, shift))


def test_custom_op_under_fullgraph_compile():
    x, _, _, scale, shift = _inputs((2, 5, 19), (2, 1, 19), torch.float32, False)
    compiled = torch.compile(lambda *a: layer_norm_modulate(*a) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, None, None, 1e-6, scale, shift),
                               layer_norm_modulate_ref(x, None, None, 1e-6, scale, shift) * 2)
