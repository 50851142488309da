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


@pytest.mark.parametrize("args", [["quant", "sdxl-1024-cfg", "rows"], ["quant", "flux-1024", "profile", "fp8_e4m3"],
                                  ["quant", "sd15-512-cfg", "rows", "kiln default,kiln default + fp8_e4m3"]])
def test_the_quant_part_takes_its_arguments(args):
    """The part's own argument check passes these (the script then needs a CUDA machine: checked up to there)."""
    check = SCRIPT.read_text().split('out="${OUT:-')[0]  # the script's argument checks, before it makes a folder
    done = subprocess.run(["bash", "-c", check + "\necho accepted", "gpu_session.sh", *args], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.strip() == "accepted", done.stderr
