"""GPU readiness without a GPU: every Kiln Triton kernel, with each launch configuration, compiles for
sm_80, sm_89 and sm_90 (fp8 builds from sm_89) with no spill and within registers and shared memory."""
import json
import os
import subprocess
import sys

import pytest

from kiln.kernels.gpu_build import (ARCHS, REGISTERS_PER_BLOCK, SHARED_LIMIT, kernel_modules, missing_toolchain,
                                    parse_ptxas_log, parse_resource_usage)

# Captured from this check (Triton 3.9). weight_only_linear fp16 x i8 128x128x64 built without its
# alignment hints spills on sm_80: ptxas's report, and cuobjdump's of the cubin, where the spill shows
# as STACK while LOCAL stays 0. group_stats fp16 NCHW on sm_90a (ptxas-blackwell): ptxas reports no
# smem, yet the cubin declares 1 KB of static shared memory, which counts against the block's limit.
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_weight_only_linear_kernel' for 'sm_80'
ptxas info    : Function properties for _weight_only_linear_kernel
    56 bytes stack frame, 96 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 56 bytes cumulative stack size, 432 bytes cmem[0]
ptxas info    : Compile time = 318.700 ms
"""
CUOBJDUMP = """
Resource usage:
 Common:
  GLOBAL:0
 Function _weight_only_linear_kernel:
  REG:255 STACK:56 SHARED:0 LOCAL:0 CONSTANT[0]:432 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
PTXAS_LOG_SM90 = (
    "ptxas-blackwell info    : 28 bytes gmem\nptxas-blackwell info    : Compiling entry function '_group_stats_kernel' "
    "for 'sm_90a'\nptxas-blackwell info    : Function properties for _group_stats_kernel\n    0 bytes stack frame, "
    "0 bytes spill stores, 0 bytes spill loads\nptxas-blackwell info    : Used 32 registers, used 1 barriers\n"
    "ptxas-blackwell info    : Compile time = 61.204 ms\n\n")
CUOBJDUMP_SM90 = """
Resource usage:
 Common:
  GLOBAL:28 CONSTANT[4]:16
 Function _group_stats_kernel:
  REG:32 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:592 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_ptxas_log_parser():
    assert parse_ptxas_log(PTXAS_LOG) == {"_weight_only_linear_kernel": {
        "arch": "sm_80", "registers": 255, "spill_stores": 96, "spill_loads": 88, "stack": 56}}
    assert parse_ptxas_log(PTXAS_LOG_SM90) == {"_group_stats_kernel": {
        "arch": "sm_90a", "registers": 32, "spill_stores": 0, "spill_loads": 0, "stack": 0}}
    assert parse_ptxas_log("") == {}


def test_resource_usage_parser():
    usage = parse_resource_usage(CUOBJDUMP)
    assert list(usage) == ["_weight_only_linear_kernel"]
    assert usage["_weight_only_linear_kernel"] == {"REG": 255, "STACK": 56, "SHARED": 0, "LOCAL": 0, "CONSTANT[0]": 432,
                                                   "TEXTURE": 0, "SURFACE": 0, "SAMPLER": 0}
    assert parse_resource_usage(CUOBJDUMP_SM90)["_group_stats_kernel"]["SHARED"] == 1024
    assert parse_resource_usage("cuobjdump info    : File 'x.cubin' does not contain device code") == {}


def test_shared_memory_limits_are_nvidias():
    # cudaDevAttrMaxSharedMemoryPerBlockOptin: A100 163 KB, L4/RTX 4090 99 KB, H100 227 KB
    assert (SHARED_LIMIT[80], SHARED_LIMIT[89], SHARED_LIMIT[90]) == (166912, 101376, 232448)


def test_every_kernel_module_lists_its_gpu_builds():
    """A new kernel cannot skip the check: a module with Triton kernels (`_kernels`) lists builds,
    each naming its kernel's arguments in order, with alignment hints only on real arguments."""
    modules = [m for m in kernel_modules() if hasattr(m, "_kernels")]
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {"geglu", "group_norm_silu", "layer_norm_modulate"}
    for module in modules:
        assert hasattr(module, "gpu_builds"), f"{module.__name__} has Triton kernels (_kernels) and no gpu_builds()"
        builds = module.gpu_builds()
        assert builds, f"{module.__name__}.gpu_builds() lists no build"
        assert len({b.name for b in builds}) == len(builds), f"{module.__name__}: build names repeat"
        for b in builds:
            assert list(b.signature) == b.fn.arg_names, b.name
            assert set(b.constexprs) == {k for k, v in b.signature.items() if v == "constexpr"}, b.name
            assert all(b.signature[a] != "constexpr" for a in b.aligned), b.name


@pytest.mark.slow  # about a minute on a 2-core CPU: every build for three targets
def test_every_build_compiles_for_each_target_within_its_limits(tmp_path):
    if reason := missing_toolchain():
        pytest.skip(reason)
    out = tmp_path / "builds.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    result = subprocess.run([sys.executable, "-m", "kiln.kernels.gpu_build", "--json", str(out)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    bad = [f"{r['module']}: {r['build']} sm_{r['arch']}: {r['problem']}" for r in rows if not r["ok"]]
    assert not bad and result.returncode == 0, "\n".join(bad) + result.stderr[-2000:]
    expected = {(m.__name__.split(".kernels.", 1)[1], b.name, arch)
                for m in kernel_modules() if hasattr(m, "gpu_builds") for b in m.gpu_builds()
                for arch in ARCHS if arch >= b.min_arch}
    assert {(r["module"], r["build"], r["arch"]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        assert r["registers"] > 0 and r["registers"] * 32 * r["num_warps"] <= REGISTERS_PER_BLOCK, r
        assert r["spills"] == 0 and r["stack_bytes"] == 0, r
        assert r["shared_bytes"] <= r["shared_limit"] == SHARED_LIMIT[r["arch"]], r
        assert r["cubin_arch"].rstrip("a") == f"sm_{r['arch']}", r
