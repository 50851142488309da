"""What it takes to build a Kiln Triton kernel for a GPU target without a GPU.

Every kernel module lists its builds in `gpu_builds()`: one `KernelBuild` per autotune config (or
per launch configuration it picks at run time) and per dtype it is launched with. The GPU build
check (tests/kernels/test_gpu_build.py) compiles each one with Triton for sm_80, sm_89 and sm_90
on the CPU and reads registers, spills and shared memory from the cubin.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelBuild:
    """One compile of one @triton.jit function.

    name: "geglu fp16 BLOCK=1024", unique within its module.
    fn: the @triton.jit function (from the module's lazily built `_kernels()`).
    signature: Triton's signature for ASTSource, constexprs included as "constexpr"
        ({"x_ptr": "*fp16", "n_cols": "i32", "BLOCK": "constexpr"}).
    constexprs: the constexpr values of this build.
    min_arch: the oldest sm it must build for (89 for kernels that use fp8 tensor cores).
    aligned: arguments Triton sees as multiples of 16 at run time (16-byte aligned pointers, sizes
        and strides divisible by 16), as it specialises them for real layers' shapes: without these
        hints a GEMM cannot vectorise its loads (and spills). Layers with odd sizes run the
        unhinted variant, which the check builds as well where a build says so (`aligned=()`).
    """

    name: str
    fn: Any
    signature: dict
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    min_arch: int = 80
    aligned: tuple[str, ...] = ()

    def attrs(self) -> dict:
        """ASTSource's attrs for the alignment hints: {(argument index,): [["tt.divisibility", 16]]}."""
        names = list(self.signature)
        return {(names.index(name),): [["tt.divisibility", 16]] for name in self.aligned}
