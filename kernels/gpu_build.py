"""Build every Kiln Triton kernel for real GPU targets on a machine without a GPU.

    python -m kiln.kernels.gpu_build [--arch 80,89,90] [--json PATH] [--jobs N]

Each module of kiln.kernels lists its launch configurations in `gpu_builds()` (kernels/_build.py).
Each is compiled by Triton for sm_80 (A100), sm_89 (L4, L40, RTX 40xx) and sm_90 (H100) down to a
cubin, exactly as a launch on that GPU would compile it (same Triton passes, same ptxas flags).
Two readings of the result, which must agree:
  - ptxas's own `-v` report of that compile (Triton runs ptxas with -v; the log is captured):
    registers, spill stores and loads, stack frame, static shared memory, and the target it built;
  - `cuobjdump -res-usage` of the cubin itself: registers, stack, static shared and local memory.
A build fails on a compile error, on any spill or stack frame (local memory), on static plus
Triton's dynamic shared memory over the target's per-block limit, or on more registers than one
block may hold. This proves the kernels compile for those GPUs within their limits; it measures
no speed and checks no result on hardware. The builds run with TRITON_INTERPRET=0 (the interpreter
has no compiler): `main` sets it, and a process that already made interpreted kernels cannot build.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

# Shared memory one thread block may use (static + dynamic, the opt-in maximum, i.e.
# cudaDevAttrMaxSharedMemoryPerBlockOptin), per NVIDIA's CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability" ("Maximum amount of shared memory per thread block"), and
# the tuning guides (docs.nvidia.com/cuda/{ampere,ada,hopper}-tuning-guide, "Shared Memory"):
# A100 (8.0) 163 KB of its 164 KB; 8.6 and 8.9 99 KB of 100 KB; H100 (9.0) 227 KB of 228 KB (CUDA
# reserves 1 KB per block). sm_80 cubins also run on 8.6 (RTX 30xx), whose 99 KB the sm_89 row checks.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REGISTERS_PER_BLOCK = 64 * 1024  # "Maximum number of 32-bit registers per thread block", same table, 5.0 to 9.0
ARCHS = (80, 89, 90)

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_CUOBJDUMP_FUNCTION = re.compile(r"^\s*Function ([^\s:]+):\s*\n\s*(.+)$", re.MULTILINE)
_CUOBJDUMP_FIELD = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")


def kernel_modules() -> list:
    """Every module under kiln.kernels (subpackages such as kernels/quant included), imported."""
    from .. import kernels

    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + ".")]


def _short(module) -> str:
    return module.__name__.split(".kernels.", 1)[1]


def discover_builds() -> list[tuple[str, object]]:
    """(module, KernelBuild) for every module of kiln.kernels that defines gpu_builds(); a module
    that defines Triton kernels (`_kernels`) without it raises, so no kernel skips the check."""
    found = []
    for module in kernel_modules():
        if hasattr(module, "gpu_builds"):
            found += [(_short(module), kb) for kb in module.gpu_builds()]
        elif hasattr(module, "_kernels"):
            raise LookupError(f"{module.__name__} defines Triton kernels (_kernels) but no gpu_builds(): "
                              "list its launch configurations (kernels/_build.py) so the GPU build check covers them")
    return found


def parse_ptxas_log(text: str) -> dict:
    """ptxas -v output -> {function: {arch, registers, spill_stores, spill_loads, stack}}."""
    functions, current = {}, None
    for line in text.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = functions[m.group(1)] = {"arch": m.group(2), "registers": None, "spill_stores": 0,
                                               "spill_loads": 0, "stack": 0}
        elif current is None:
            continue
        elif m := _PTXAS_FRAME.search(line):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif m := _PTXAS_USED.search(line):
            current["registers"] = int(m.group(1))
    return functions


def parse_resource_usage(text: str) -> dict:
    """cuobjdump -res-usage output -> {function: {"REG": 38, "STACK": 0, "SHARED": 0, "LOCAL": 0, ...}}."""
    return {m.group(1): {k: int(v) for k, v in _CUOBJDUMP_FIELD.findall(m.group(2))}
            for m in _CUOBJDUMP_FUNCTION.finditer(text)}


def missing_toolchain(archs=ARCHS) -> Optional[str]:
    """Why these targets cannot be built here (no Triton, no NVIDIA backend, no ptxas/cuobjdump), or None."""
    try:
        import triton.backends.nvidia.compiler as nvidia
        from triton import knobs
    except Exception as exc:  # noqa: BLE001  (no triton, or a build without the NVIDIA backend)
        return f"Triton's NVIDIA backend does not import: {exc}"
    try:
        for arch in archs:
            nvidia.get_ptxas(arch)
        knobs.nvidia.cuobjdump.path
    except RuntimeError as exc:  # knobs raise "Cannot find <tool>"
        return f"Triton's NVIDIA toolchain is incomplete: {exc}"
    return None


def build(kb, arch: int) -> dict:
    """Compile one KernelBuild for sm_<arch> and check it: registers, spills and shared memory."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    name = getattr(kb.fn, "__name__", str(kb.fn))
    row = {"kernel": name, "build": kb.name, "arch": arch, "num_warps": kb.num_warps, "num_stages": kb.num_stages,
           "registers": None, "spills": None, "shared_bytes": None, "shared_limit": SHARED_LIMIT[arch],
           "ok": False, "problem": None}
    if not isinstance(kb.fn, JITFunction):
        row["problem"] = f"{name} is {type(kb.fn).__name__}, not a JITFunction: build with TRITON_INTERPRET=0"
        return row
    if list(kb.signature) != kb.fn.arg_names:  # attrs() indexes arguments by their place in the signature
        row["problem"] = f"signature {list(kb.signature)} is not {name}'s arguments {kb.fn.arg_names} in order"
        return row
    log, start = io.StringIO(), time.perf_counter()
    try:
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True       # Triton prints ptxas -v's report of this very compile
            knobs.compilation.always_compile = True  # a cached kernel would compile (and report) nothing
            compiled = triton.compile(ASTSource(kb.fn, kb.signature, kb.constexprs, kb.attrs()),
                                      target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": kb.num_warps, "num_stages": kb.num_stages})
    except Exception as exc:  # noqa: BLE001  this build's problem; the others still build
        first = str(exc).strip().splitlines()
        row["problem"] = f"does not compile: {type(exc).__name__}: {first[0] if first else ''}"[:300]
        return row
    row["compile_s"] = round(time.perf_counter() - start, 2)
    function = compiled.metadata.name
    ptxas = parse_ptxas_log(log.getvalue()).get(function)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        dump = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True)
    cubin = parse_resource_usage(dump.stdout).get(function)
    if ptxas is None or cubin is None:
        row["problem"] = (f"no resource report for {function}: ptxas log {log.getvalue()[-200:]!r}, "
                          f"cuobjdump {dump.stdout[-200:]!r} {dump.stderr[-200:]!r}")
        return row
    threads = 32 * kb.num_warps
    row.update(registers=cubin["REG"], spills=ptxas["spill_stores"] + ptxas["spill_loads"],
               spill_stores=ptxas["spill_stores"], spill_loads=ptxas["spill_loads"],
               stack_bytes=max(ptxas["stack"], cubin.get("STACK", 0)), local_bytes=cubin.get("LOCAL", 0),
               static_shared=cubin.get("SHARED", 0), dynamic_shared=compiled.metadata.shared,
               shared_bytes=cubin.get("SHARED", 0) + compiled.metadata.shared, cubin_arch=ptxas["arch"])
    problems = []
    if ptxas["arch"].rstrip("a") != f"sm_{arch}":
        problems.append(f"ptxas built {ptxas['arch']}, not sm_{arch}")
    if ptxas["registers"] != cubin["REG"]:
        problems.append(f"ptxas reports {ptxas['registers']} registers, the cubin {cubin['REG']}")
    if not 0 < row["registers"] <= REGISTERS_PER_BLOCK // threads:
        problems.append(f"{row['registers']} registers x {threads} threads exceed {REGISTERS_PER_BLOCK} per block")
    if row["spills"]:
        problems.append(f"spills ({row['spill_stores']} B stored, {row['spill_loads']} B loaded)")
    if row["stack_bytes"] or row["local_bytes"]:
        problems.append(f"local memory ({row['stack_bytes']} B stack frame, {row['local_bytes']} B local)")
    if row["shared_bytes"] > row["shared_limit"]:
        problems.append(f"shared memory {row['shared_bytes']} B > {row['shared_limit']} B")
    row["ok"], row["problem"] = not problems, "; ".join(problems) or None
    return row


_TASKS: list = []  # (module, KernelBuild, arch), set before the worker processes fork


def _build_task(i: int) -> dict:
    module, kb, arch = _TASKS[i]
    return {"module": module, **build(kb, arch)}


def run(archs=ARCHS, jobs: int = 0) -> list[dict]:
    """Build every discovered KernelBuild for every arch it supports (arch >= min_arch); jobs
    processes at once (0: one per CPU; they fork, so only where fork exists)."""
    global _TASKS
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("set TRITON_INTERPRET=0: the GPU build check compiles, the interpreter cannot")
    _TASKS = [(module, kb, arch) for module, kb in discover_builds() for arch in archs if arch >= kb.min_arch]
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1 or sys.platform == "win32":
        return [_build_task(i) for i in range(len(_TASKS))]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(jobs, len(_TASKS))) as pool:
        return pool.map(_build_task, range(len(_TASKS)), chunksize=1)


def table(rows: list[dict], archs=ARCHS) -> str:
    """One line per build; per arch: registers / spilled bytes / shared memory in KiB (- = not built)."""
    cells, order = {}, []
    for r in rows:
        key = (r["module"], r["build"])
        if key not in cells:
            order.append(key)
            cells[key] = {}
        mark = "" if r["ok"] else " FAIL"
        cells[key][r["arch"]] = ("error" + mark if r["registers"] is None else
                                 f"{r['registers']:>3} / {r['spills']:>3} / {r['shared_bytes'] / 1024:6.1f}{mark}")
    width = max([len(f"{m}: {b}") for m, b in order] + [5])
    head = f"{'build':<{width}}" + "".join(f"  {'sm_' + str(a) + ' regs/spill B/smem KiB':<29}" for a in archs)
    lines = [head, "-" * len(head)]
    for m, b in order:
        lines.append(f"{m + ': ' + b:<{width}}" + "".join(f"  {cells[(m, b)].get(a, '-'):<29}" for a in archs))
    return "\n".join(lines)


def _versions(archs) -> dict:
    import triton
    import triton.backends.nvidia.compiler as nvidia
    from triton import knobs

    tools = {f"ptxas sm_{a}": nvidia.get_ptxas(a).version for a in archs}
    return {"triton": triton.__version__, **tools, "cuobjdump": knobs.nvidia.cuobjdump.version}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)), help="comma-separated sm numbers (80,86,89,90)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--jobs", type=int, default=0, help="builds at once (default: one per CPU)")
    args = parser.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(","))
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        parser.error(f"no shared-memory limit known for sm {unknown}; known: {sorted(SHARED_LIMIT)}")
    os.environ["TRITON_INTERPRET"] = "0"  # read when a @triton.jit is made, i.e. at each module's first _kernels()
    if reason := missing_toolchain(archs):
        print(f"cannot build: {reason}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = run(archs, args.jobs)
    elapsed = time.perf_counter() - start
    print(table(rows, archs))
    problems = [r for r in rows if not r["ok"]]
    for r in problems:
        print(f"FAIL {r['module']}: {r['build']} sm_{r['arch']}: {r['problem']}")
    print(f"{len(rows)} builds ({len({(r['module'], r['build']) for r in rows})} configurations x "
          f"sm {','.join(map(str, archs))}), {len(problems)} with a problem, {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"archs": list(archs), "shared_limit": {str(a): SHARED_LIMIT[a] for a in archs},
                       "registers_per_block": REGISTERS_PER_BLOCK, "tools": _versions(archs),
                       "elapsed_s": round(elapsed, 1), "results": rows}, f, indent=1)
            f.write("\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
