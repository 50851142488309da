"""LayerNorm then AdaLN modulation in one pass (kiln::layer_norm_modulate).

    out = layer_norm(x, (C,), weight, bias, eps) * scale + shift

Every DiT block (SD3, Flux, PixArt; diffusers' and ComfyUI's) normalises its input, then
modulates it per sample and channel with `scale` (AdaLN's `1 + scale`, computed beforehand on
the small (B, C) tensor) and `shift`, shaped (B, 1, C) or (1, 1, C). Eager runs the norm, the
multiply and the add as three full passes over the activation with two intermediate tensors;
this kernel reads each row once and writes it once, with fp32 statistics (mean first, then
the centred sum of squares) held in registers: one program per row, the whole row in one block.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ._build import KernelBuild
from ._library import define_op, use_triton

MAX_CHANNELS = 16384  # one row in one block; wider rows are left to torch (the pass checks this)


def layer_norm_modulate_ref(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                            eps: float, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps) * scale + shift


def out_dtype(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.dtype:
    """Eager's result dtype (type promotion of the norm's output with scale, then with shift)."""
    return torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)


def modulates_per_sample_channel(t_shape, x_shape) -> bool:
    """True if a tensor of `t_shape` modulates one of `x_shape` (B, ..., C) per sample and channel:
    (B or 1, 1, ..., 1, C or 1), right-aligned. Sizes may be ints or symbolic size expressions,
    compared structurally (the pass checks fake shapes with it and guards nothing)."""
    if len(x_shape) < 2 or not 1 <= len(t_shape) <= len(x_shape):
        return False
    sizes = [1] * (len(x_shape) - len(t_shape)) + list(t_shape)
    return sizes[0] in (1, x_shape[0]) and sizes[-1] in (1, x_shape[-1]) and all(s == 1 for s in sizes[1:-1])


def per_sample_channel(t: torch.Tensor, x: torch.Tensor) -> Optional[torch.Tensor]:
    """`t` as a (B, C) view (stride 0 where it broadcasts) if it modulates x per sample and channel; else None."""
    if not modulates_per_sample_channel(tuple(t.shape), tuple(x.shape)):
        return None
    t = t.reshape((1,) * (x.dim() - t.dim()) + tuple(t.shape))
    return t.reshape(t.shape[0], t.shape[-1]).expand(x.shape[0], x.shape[-1])


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _layer_norm_modulate_kernel(x_ptr, out_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, C, rows_per_sample, eps,
                                    scale_stride_b, scale_stride_c, shift_stride_b, shift_stride_c,
                                    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        sample = row // rows_per_sample
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / C
        d = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / C + eps)
        y = d * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=1.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + sample * scale_stride_b + cols * scale_stride_c, mask=mask, other=1.0)
        shift = tl.load(shift_ptr + sample * shift_stride_b + cols * shift_stride_c, mask=mask, other=0.0)
        y = y * scale.to(tl.float32) + shift.to(tl.float32)
        tl.store(out_ptr + row * C + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return _layer_norm_modulate_kernel


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def layer_norm_modulate_triton(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                               eps: float, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Launch the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1). x: (B, ..., C)."""
    import triton

    channels = x.shape[-1]
    assert 0 < channels <= MAX_CHANNELS, f"layer_norm_modulate handles up to {MAX_CHANNELS} channels, got {channels}"
    scale_bc, shift_bc = per_sample_channel(scale, x), per_sample_channel(shift, x)
    assert scale_bc is not None and shift_bc is not None, (
        f"scale {tuple(scale.shape)} / shift {tuple(shift.shape)} do not modulate x {tuple(x.shape)} per sample and channel")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype(x, scale, shift), device=x.device)
    if x.numel() == 0:
        return out
    rows = x.numel() // channels
    placeholder = scale_bc  # a valid pointer for absent weight/bias (never read)
    block = triton.next_power_of_2(channels)
    _kernels()[(rows,)](
        x, out, weight.contiguous() if weight is not None else placeholder,
        bias.contiguous() if bias is not None else placeholder, scale_bc, shift_bc,
        channels, rows // x.shape[0], eps,
        scale_bc.stride(0), scale_bc.stride(1), shift_bc.stride(0), shift_bc.stride(1),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=_num_warps(block))
    return out


def _layer_norm_modulate(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                         scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    if use_triton(x, "layer_norm_modulate"):
        return layer_norm_modulate_triton(x, weight, bias, eps, scale, shift)
    return layer_norm_modulate_ref(x, weight, bias, eps, scale, shift)


def _layer_norm_modulate_fake(x, weight, bias, eps, scale, shift):
    return x.new_empty(x.shape, dtype=out_dtype(x, scale, shift))


layer_norm_modulate_op = define_op("layer_norm_modulate", _layer_norm_modulate, _layer_norm_modulate_fake)


def layer_norm_modulate(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                        scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln.layer_norm_modulate(x, weight, bias, eps, scale, shift)


# Hidden sizes it is launched with (PixArt 1152, SD3 1536, Flux 3072) and the widest it takes
GPU_BUILD_CHANNELS = {"PixArt": 1152, "SD3": 1536, "Flux": 3072, "MAX_CHANNELS": MAX_CHANNELS}


def gpu_builds() -> list[KernelBuild]:
    """One build per BLOCK / warp count the launcher picks for GPU_BUILD_CHANNELS, fp16/bf16/fp32,
    without affine (AdaLN's LayerNorm has none; fuse_adaln_modulation passes None). scale and shift
    are (B, C) views with unit channel stride, which Triton compiles as a constant; C and the sample
    strides are multiples of 16, rows_per_sample (tokens: SD3 has 154 text tokens) need not be."""
    import triton

    configs = {}
    for model, channels in GPU_BUILD_CHANNELS.items():
        block = triton.next_power_of_2(channels)
        configs.setdefault((block, _num_warps(block)), []).append(f"{model} {channels}")
    return [KernelBuild(f"layer_norm_modulate {dt} BLOCK={block} warps={warps} ({', '.join(users)})", _kernels(),
                        {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}",
                         "scale_ptr": f"*{dt}", "shift_ptr": f"*{dt}", "C": "i32", "rows_per_sample": "i32",
                         "eps": "fp32", "scale_stride_b": "i32", "scale_stride_c": "constexpr", "shift_stride_b": "i32",
                         "shift_stride_c": "constexpr", "HAS_WEIGHT": "constexpr", "HAS_BIAS": "constexpr",
                         "BLOCK": "constexpr"},
                        {"scale_stride_c": 1, "shift_stride_c": 1, "HAS_WEIGHT": False, "HAS_BIAS": False,
                         "BLOCK": block},
                        num_warps=warps,
                        aligned=("x_ptr", "out_ptr", "w_ptr", "b_ptr", "scale_ptr", "shift_ptr", "C", "scale_stride_b",
                                 "shift_stride_b"))
            for dt in ("fp16", "bf16", "fp32") for (block, warps), users in sorted(configs.items())]
