"""GroupNorm (+ SiLU) in two kernels, NCHW or channels-last, no layout copies (kiln::group_norm_silu).

Design: a statistics kernel computes mean and 1/std per (sample, group) in fp32 with a two-pass
loop (mean first, then the centred sum of squares: no E[x^2]-E[x]^2 cancellation), then an
elementwise kernel walks the tensor in memory order (coalesced in either layout), normalises,
applies the affine and SiLU, and writes once. Eager does GroupNorm and SiLU as separate full
passes with an intermediate tensor. One program per (sample, group) for the statistics
leaves an H100 under-occupied at small batch (2 x 32 = 64 programs); splitting a group across
programs is the next step once the GPU suite shows where the time goes.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ._build import KernelBuild
from ._library import define_op, use_triton

STATS_BLOCK = 1024
APPLY_BLOCK = 1024


def _memory_format(x: torch.Tensor):
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def group_norm_silu_ref(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, eps: float = 1e-5, silu: bool = True) -> torch.Tensor:
    out = F.group_norm(x, num_groups, weight, bias, eps)
    if silu:
        out = F.silu(out)
    return out.contiguous(memory_format=_memory_format(x))


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _group_stats_kernel(x_ptr, mean_ptr, rstd_ptr, C, S, G, stride_n, stride_c, stride_s, eps,
                            CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)  # one (sample, group)
        n = (pid // G).to(tl.int64)
        g = pid % G
        cg = C // G
        count = cg * S
        base = x_ptr + n * stride_n + (g * cg).to(tl.int64) * stride_c
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, count, BLOCK):
            e = start + tl.arange(0, BLOCK)
            if CHANNELS_LAST:  # memory order inside a group: spatial-major, channel-minor
                c, s = e % cg, e // cg
            else:
                c, s = e // S, e % S
            acc += tl.load(base + c * stride_c + s.to(tl.int64) * stride_s, mask=e < count, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / count
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, count, BLOCK):
            e = start + tl.arange(0, BLOCK)
            if CHANNELS_LAST:
                c, s = e % cg, e // cg
            else:
                c, s = e // S, e % S
            v = tl.load(base + c * stride_c + s.to(tl.int64) * stride_s, mask=e < count, other=0.0).to(tl.float32)
            d = tl.where(e < count, v - mean, 0.0)
            acc += d * d
        var = tl.sum(acc, axis=0) / count
        tl.store(mean_ptr + pid, mean)
        tl.store(rstd_ptr + pid, 1.0 / tl.sqrt(var + eps))

    @triton.jit
    def _group_apply_kernel(x_ptr, out_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, numel, C, S, G,
                            CHANNELS_LAST: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SILU: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # offset in memory order
        mask = o < numel
        if CHANNELS_LAST:
            c = o % C
            n = o // (S * C)
        else:
            c = (o // S) % C
            n = o // (C * S)
        stat = n * G + c // (C // G)
        x = tl.load(x_ptr + o, mask=mask, other=0.0).to(tl.float32)
        y = (x - tl.load(mean_ptr + stat, mask=mask, other=0.0)) * tl.load(rstd_ptr + stat, mask=mask, other=1.0)
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + c, mask=mask, other=1.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_ptr + o, y.to(out_ptr.dtype.element_ty), mask=mask)

    return _group_stats_kernel, _group_apply_kernel


def group_norm_silu_triton(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None, eps: float = 1e-5, silu: bool = True) -> torch.Tensor:
    """Launch the Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1). x: (N, C, *spatial)."""
    assert x.dim() >= 3 and x.shape[1] % num_groups == 0, f"x {tuple(x.shape)} with {num_groups} groups"
    fmt = _memory_format(x)
    if fmt is torch.contiguous_format and not x.is_contiguous():
        x = x.contiguous()
    channels_last = fmt is not torch.contiguous_format
    n, c = x.shape[:2]
    s = x.numel() // max(n * c, 1)
    out = torch.empty_like(x)  # dense input: same strides, so the same memory format
    if x.numel() == 0:
        return out
    mean = torch.empty(n * num_groups, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    stats, apply = _kernels()
    stride_s = c if channels_last else 1
    stats[(n * num_groups,)](x, mean, rstd, c, s, num_groups, x.stride(0), x.stride(1), stride_s, eps,
                             CHANNELS_LAST=channels_last, BLOCK=STATS_BLOCK)
    w = weight.contiguous() if weight is not None else mean  # placeholder pointer when absent
    b = bias.contiguous() if bias is not None else mean
    apply[(triton_cdiv(x.numel(), APPLY_BLOCK),)](x, out, mean, rstd, w, b, x.numel(), c, s, num_groups,
                                                  CHANNELS_LAST=channels_last, HAS_WEIGHT=weight is not None,
                                                  HAS_BIAS=bias is not None, SILU=silu, BLOCK=APPLY_BLOCK)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _group_norm_silu(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     eps: float, silu: bool = True) -> torch.Tensor:
    if use_triton(x, "group_norm_silu"):
        return group_norm_silu_triton(x, num_groups, weight, bias, eps, silu)
    return group_norm_silu_ref(x, num_groups, weight, bias, eps, silu)


def _group_norm_silu_fake(x, num_groups, weight, bias, eps, silu=True):
    return torch.empty_like(x, memory_format=_memory_format(x))


group_norm_silu_op = define_op("group_norm_silu", _group_norm_silu, _group_norm_silu_fake)


def group_norm_silu(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None, eps: float = 1e-5, silu: bool = True) -> torch.Tensor:
    return torch.ops.kiln.group_norm_silu(x, num_groups, weight, bias, eps, silu)


def gpu_builds() -> list[KernelBuild]:
    """As launched: BLOCK=1024, 4 warps, NCHW and channels-last, fp16/bf16/fp32 (ComfyUI often runs
    the VAE in fp32), affine with SiLU (what fuse_group_norm_silu emits). The unit stride (spatial in
    NCHW, channel in channels-last) is 1, which Triton compiles as a constant; channels (320 to 1280,
    VAE 128 to 512), groups (32), spatial sizes (8x8 up) and the other strides are multiples of 16."""
    stats, apply = _kernels()
    builds = []
    for dt in ("fp16", "bf16", "fp32"):
        for channels_last in (False, True):
            layout = "channels_last" if channels_last else "NCHW"
            unit = "stride_c" if channels_last else "stride_s"
            signature = {"x_ptr": f"*{dt}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "C": "i32", "S": "i32",
                         "G": "i32", "stride_n": "i32", "stride_c": "i32", "stride_s": "i32", "eps": "fp32",
                         "CHANNELS_LAST": "constexpr", "BLOCK": "constexpr"}
            signature[unit] = "constexpr"
            builds.append(KernelBuild(
                f"group_stats {dt} {layout} BLOCK={STATS_BLOCK}", stats, signature,
                {unit: 1, "CHANNELS_LAST": channels_last, "BLOCK": STATS_BLOCK},
                aligned=tuple(a for a in ("x_ptr", "mean_ptr", "rstd_ptr", "C", "S", "G", "stride_n", "stride_c",
                                          "stride_s") if a != unit)))
            builds.append(KernelBuild(
                f"group_apply {dt} {layout} affine silu BLOCK={APPLY_BLOCK}", apply,
                {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "w_ptr": f"*{dt}",
                 "b_ptr": f"*{dt}", "numel": "i32", "C": "i32", "S": "i32", "G": "i32",
                 "CHANNELS_LAST": "constexpr", "HAS_WEIGHT": "constexpr", "HAS_BIAS": "constexpr",
                 "SILU": "constexpr", "BLOCK": "constexpr"},
                {"CHANNELS_LAST": channels_last, "HAS_WEIGHT": True, "HAS_BIAS": True, "SILU": True,
                 "BLOCK": APPLY_BLOCK},
                aligned=("x_ptr", "out_ptr", "mean_ptr", "rstd_ptr", "w_ptr", "b_ptr", "numel", "C", "S", "G")))
    return builds
