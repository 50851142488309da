"""benchmarks/gpu_session.sh runs on a CUDA machine; here it must at least parse
and refuse a wrong part before it installs or runs anything."""
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_session.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("args", [[], ["bogus"], ["suite"], ["shapes", "sideways"], ["shapes", "kiln", "sd99"], ["tests", "extra"],
                                  ["tests", "tests/no_such_test.py"], ["tests", "/etc/passwd"],
                                  ["tests", "tests/../README.md"], ["host"],
                                  ["host", "../../tmp/x"], ["host", "sd15 512"],
                                  ["prompts", "sd99"], ["prompts", "sdxl", "extra"],
                                  ["graphs"], ["graphs", "sd99"], ["graphs", "vae-decode-1024"],
                                  ["graphs", "sd15-512-cfg", "extra"],
                                  ["quant"], ["quant", "sdxl-1024-cfg"], ["quant", "../x", "rows"],
                                  ["quant", "sdxl-1024-cfg", "sideways"], ["quant", "sdxl-1024-cfg", "profile"],
                                  ["quant", "sdxl-1024-cfg", "profile", "fp8; rm -rf /"],
                                  ["quant", "sdxl-1024-cfg", "profile", "fp8_e4m3", "extra"],
                                  ["quant", "sdxl-1024-cfg", "rows", "kiln default;ls"],
                                  ["quant", "sdxl-1024-cfg", "rows", "kiln default", "extra"]])
def test_wrong_parts_are_refused_with_the_usage(args, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path)))
    assert done.returncode == 2 and done.stderr.startswith("usage: gpu_session.sh tests")
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("case", ["sd15-512-cfg", "sdxl-1024-cfg", "flux-1024"])
def test_the_graphs_part_plans_one_case_in_480_s(case, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "graphs", case], capture_output=True, text=True,
                          env=dict(os.environ, OUT=str(tmp_path), DRY_RUN="1"))
    assert done.returncode == 0, done.stderr
    budget, imports, size, guard, suite = done.stdout.strip().splitlines()
    assert budget == "budget 480 s"
    assert "import torch, triton, diffusers, kiln.compiler.graphs" in imports and "get_allocator_backend" in imports
    assert size.startswith("du -sh") and f"graphs-{case}/bundle-size.txt" in size
    assert "tests/graphs/test_recorder.py tests/graphs/test_on_cuda.py" in guard
    assert f"--cases {case} --variants 'kiln default,torch.compile reduce-overhead' --reps 10 --kernel-tables" in suite
    for path in ("tests/graphs/test_recorder.py", "tests/graphs/test_on_cuda.py"):
        assert (SCRIPT.parents[1] / path).exists()
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    from kiln.benchmarks.gpu_suite import FULL_CASES, VARIANTS

    assert case in {c.name for c in FULL_CASES}
    assert {"kiln default", "torch.compile reduce-overhead"} <= set(VARIANTS)


@pytest.mark.parametrize("args", [["kernel-table", "sd99"], ["kernel-table", "sdxl-1024-cfg", "extra"],
                                  ["kernel-table", "../../etc"], ["kernel-records"], ["kernel-records", "sdxl"],
                                  ["kernel-records", "sdxl-1024-cfg", "fuse_nothing"],
                                  ["kernel-records", "sdxl-1024-cfg", "fuse_geglu", "extra"]])
def test_the_kernel_parts_take_one_suite_case_and_a_kernel_pass(args, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path)))
    assert done.returncode == 2 and done.stderr.startswith("usage: gpu_session.sh tests")
    assert "kernel-table [CASE] | kernel-records CASE [PASS]" in done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, command", [
    (["kernel-table"], "-m kiln.benchmarks.kernel_table --case sdxl-1024-cfg --reps 10 --out {out}"),
    (["kernel-table", "flux-1024"], "-m kiln.benchmarks.kernel_table --case flux-1024 --reps 10 --out {out}"),
    (["kernel-records", "sd15-512-cfg"], "-m kiln.benchmarks.kernel_pass_records --case sd15-512-cfg --reps 10 --out {out}"),
    (["kernel-records", "sdxl-1024-cfg", "fuse_geglu"],
     "-m kiln.benchmarks.kernel_pass_records --case sdxl-1024-cfg --passes fuse_geglu --reps 10 --out {out}"),
])
def test_the_kernel_parts_run_their_tool_under_a_time_limit(args, command, tmp_path):
    """With a python3 that only writes down how it was called: the command each part runs."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TMPDIR=str(tmp_path), PATH=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=SCRIPT.parents[1])
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines()[-1] == command.format(out=out)


@pytest.mark.parametrize("args", [["quant", "sdxl-1024-cfg", "rows"], ["quant", "flux-1024", "profile", "fp8_e4m3"],
                                  ["quant", "sd15-512-cfg", "rows", "kiln default,kiln default + fp8_e4m3"]])
def test_the_quant_part_takes_its_arguments(args):
    """The part's own argument check passes these (the script then needs a CUDA machine: checked up to there)."""
    check = SCRIPT.read_text().split('out="${OUT:-')[0]  # the script's argument checks, before it makes a folder
    done = subprocess.run(["bash", "-c", check + "\necho accepted", "gpu_session.sh", *args], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.strip() == "accepted", done.stderr


@pytest.mark.parametrize("args", [["comfyui"], ["comfyui", "sd99"], ["comfyui", "sd15", "int4"],
                                  ["comfyui", "flux", "fp8", "16GB"], ["comfyui", "sdxl", "default", "16", "extra"],
                                  ["comfyui", "flux", "default", "16", "dynamic", "extra"],
                                  ["comfyui", "flux", "default", "", "dynamic;ls"],
                                  ["comfyui", "tests", "tests/gpu"], ["comfyui", "tests", "tests/comfyui/../../x"],
                                  ["comfyui", "tests", "tests/comfyui/test_no_such.py"], ["comfyui", "tests", "/etc"]])
def test_wrong_comfyui_parts_are_refused_with_the_usage(args, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path)))
    assert done.returncode == 2 and "comfyui sd15|sdxl|flux" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("args", [["comfyui", "flux"], ["comfyui", "flux", "fp8", "16"],
                                  ["comfyui", "flux", "default", "16", "dynamic"], ["comfyui", "tests"],
                                  ["comfyui", "tests", "tests/comfyui/test_comfy_partial_load.py", "tests/comfyui"]])
def test_the_comfyui_part_takes_its_arguments(args):
    """The part's own argument check passes these, the memory cap and core's dynamic VRAM among them."""
    check = SCRIPT.read_text().split('out="${OUT:-')[0]  # the script's argument checks, before it makes a folder
    done = subprocess.run(["bash", "-c", check + "\necho accepted", "gpu_session.sh", *args], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.strip() == "accepted", done.stderr
