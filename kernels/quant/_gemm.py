"""What the quantized GEMM kernels share: their tile configurations and the interpreter switch.

A config is plain data here (this module never imports Triton); `autotuned` turns a list of them
into `triton.autotune` configs. Under TRITON_INTERPRET=1 (the CPU tests) autotuning would run every
config in the interpreter, so the kernel gets one small config instead (16x16x16: the tests' odd
shapes then cross several tiles in M, N and K).
"""
from __future__ import annotations

from typing import NamedTuple

INT8_MAX = 127.0
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
EPS = 1e-12      # scale of an all-zero row or tensor (its values quantize to 0); compiler/quantize uses the same


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"

    def constexprs(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": GROUP_M}


GROUP_M = 8  # output tiles walked in groups of 8 tile-rows, so a wave of programs reuses the weight tiles in L2
INTERPRET_CONFIG = GemmConfig(16, 16, 16, 4, 1)


def interpreting() -> bool:
    """Does @triton.jit give interpreted functions now (TRITON_INTERPRET, read as Triton reads it)?"""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def autotuned(fn, configs: list[GemmConfig], interpret: bool):
    """`triton.autotune(configs, key=["N", "K"])(fn)`; one small config under the interpreter."""
    import triton

    chosen = [INTERPRET_CONFIG] if interpret else configs
    return triton.autotune(
        configs=[triton.Config(c.constexprs(), num_warps=c.num_warps, num_stages=c.num_stages) for c in chosen],
        key=["N", "K"])(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_dtype(dtype) -> str:
    """Triton's name of a torch dtype in a kernel signature ("*fp16" is a pointer to it)."""
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8",
            torch.int32: "i32", torch.float8_e4m3fn: "fp8e4nv"}[dtype]
