"""benchmarks/comfy_bundle.py: which of ComfyUI's requirements a CUDA machine gets as wheels, and, where
COMFYUI_PATH points at a ComfyUI tree, the trimmed tree, its manifest and the size check (no wheels are
downloaded here: the wheels the machine lacks are listed, not fetched)."""
import json
import os
import tarfile
from pathlib import Path

import pytest

from kiln.benchmarks import comfy_bundle

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
needs_comfyui = pytest.mark.skipif(not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")),
                                   reason="COMFYUI_PATH is not set to a ComfyUI tree")


def _fake_tree(tmp_path: Path) -> Path:
    (tmp_path / "requirements.txt").write_text(
        "comfyui-frontend-package==1.49.6\ntorch\nav>=16.0.0\ncomfy-kitchen==0.2.31\nwinonly; sys_platform == 'win32'\n"
        "\n#non essential dependencies:\nkornia>=0.7.1\nPyOpenGL>=3.1.8\n")
    return tmp_path


def test_wanted_are_the_requirements_the_machine_lacks(tmp_path):
    have = comfy_bundle.target_packages(comfy_bundle.TARGET_PACKAGES)
    assert {"torch", "transformers", "safetensors", "einops", "aiohttp"} <= have
    wanted, skipped = comfy_bundle.wanted_from_requirements(_fake_tree(tmp_path), have, {"av": "18.1.0"})
    assert {w.name: w.spec for w in wanted} == {
        "av": "av==18.1.0",                           # the version installed beside the tree, as it fits
        "comfy-kitchen": "comfy-kitchen==0.2.31",     # the requirement's own pin
        "kornia": "kornia>=0.7.1"}                    # non-essential, but Canny needs it
    assert set(skipped) == {"comfyui-frontend-package", "pyopengl"}   # torch: the machine has it; winonly: not Linux


def test_a_bundle_over_the_limit_names_its_biggest_parts():
    with pytest.raises(comfy_bundle.BundleError, match=r"biggest: av.whl 40\.0 MiB, comfyui.tar.xz 5\.0 MiB"):
        comfy_bundle.check_size({"comfyui.tar.xz": 5 * 2**20, "av.whl": 40 * 2**20, "x.whl": 1}, 30 * 2**20)
    comfy_bundle.check_size({"comfyui.tar.xz": 5 * 2**20}, 30 * 2**20)


@needs_comfyui
@pytest.mark.slow
def test_the_tree_is_trimmed_listed_and_checked(tmp_path):
    manifest = comfy_bundle.assemble(Path(COMFYUI_PATH), tmp_path / "bundle", wheels=False, log=lambda msg: None)
    with tarfile.open(tmp_path / "bundle" / comfy_bundle.ARCHIVE) as tar:
        names = set(tar.getnames())
    for needed in ("main.py", "server.py", "nodes.py", "execution.py", "folder_paths.py",
                   "comfy/model_management.py", "comfy_extras/nodes_torch_compile.py", "custom_nodes", "web"):
        assert f"ComfyUI/{needed}" in names, needed
    assert not any(n.startswith(("ComfyUI/tests/", "ComfyUI/models/")) or "__pycache__" in n for n in names)
    listed = {path for path, _ in manifest["comfyui"]["files"]}
    assert {f"ComfyUI/{p}" for p in listed} == {n for n in names if not n.endswith(("custom_nodes", "/web"))}
    assert "tests/" in manifest["comfyui"]["dropped"] and "models/" in manifest["comfyui"]["dropped"]
    assert manifest["total_bytes"] <= manifest["limit_bytes"]
    assert json.loads((tmp_path / "bundle" / "manifest.json").read_text()) == manifest
    with pytest.raises(comfy_bundle.BundleError, match="comfyui.tar.xz"):   # a limit below the tree alone
        comfy_bundle.assemble(Path(COMFYUI_PATH), tmp_path / "small", wheels=False, limit_mib=1, log=lambda m: None)
