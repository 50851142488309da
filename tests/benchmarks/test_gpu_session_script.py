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
                                  ["prompts", "sd99"], ["prompts", "sdxl", "extra"]])
def test_wrong_parts_are_refused_with_the_usage(args, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path)))
    assert done.returncode == 2 and done.stderr.startswith("usage: gpu_session.sh tests")
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("args", [["comfyui"], ["comfyui", "sd99"], ["comfyui", "sd15", "int4"],
                                  ["comfyui", "flux", "fp8", "16GB"], ["comfyui", "sdxl", "default", "16", "extra"]])
def test_wrong_comfyui_parts_are_refused_with_the_usage(args, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path)))
    assert done.returncode == 2 and "comfyui sd15|sdxl|flux" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing ran
