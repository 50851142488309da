"""benchmarks/comfy_workflows.py must not rot: its eager and Kiln rows and Kiln's checks on a tiny SD1.5, one
step each, in this ComfyUI process (no fresh-process runs). Runs when COMFYUI_PATH points at a ComfyUI tree;
skips otherwise."""
import json
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args


@pytest.mark.slow
def test_a_minimal_row_and_kilns_checks(tmp_path):
    from kiln.benchmarks import comfy_workflows

    assert comfy_workflows.main(["--comfyui", COMFYUI_PATH, "--model", "sd15", "--device", "cpu", "--steps", "1",
                                 "--check-steps", "1", "--variants", "eager,kiln", "--no-cold",
                                 "--out", str(tmp_path), "--tag", "test"]) == 0
    (result_file,) = tmp_path.glob("*-cpu-comfyui-test.json")
    result = json.loads(result_file.read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows["eager"]["s_per_it"] > 0 and rows["eager"]["psnr_db"] is None
    assert rows["kiln"]["psnr_db"] == "identical" or rows["kiln"]["psnr_db"] >= 40
    assert rows["kiln"]["kiln"]["fallback"] is None
    checks = {c["check"]: c for c in result["checks"]}
    assert set(checks) == {"LoRA after Kiln at 0.5", "LoRA after Kiln at 1", "second resolution", "batch 2",
                           "ControlNet in the chain", "attention patch after Kiln"}
    for check in checks.values():   # the right image; nothing recompiled but for a patch that changes a block's code
        assert check["psnr_db"] == "identical" or check["psnr_db"] >= 40, check
        assert check["fallback"] is None, check
        if check["check"] != "attention patch after Kiln":   # a graph per region it reaches, where regions compiled
            assert check["new_recompiles"] == 0, check
    assert (tmp_path / result_file.name.replace(".json", ".log")).read_text().count("check ") == len(checks)


@pytest.mark.slow
def test_rows_on_a_card_too_small_for_the_model_record_comfyuis_partial_load_and_kilns_verdict(tmp_path, small_card):
    from kiln.benchmarks import comfy_workflows

    small_card["fraction"] = 0.5   # ComfyUI loads half the model (conftest.py's small card)
    assert comfy_workflows.main(["--comfyui", COMFYUI_PATH, "--model", "sd15", "--device", "cpu", "--steps", "1",
                                 "--variants", "eager,kiln", "--no-checks", "--no-cold", "--out", str(tmp_path),
                                 "--tag", "small-card", "--kiln-advanced", "measure_regions: false"]) == 0
    (result_file,) = tmp_path.glob("*-cpu-comfyui-small-card.json")
    rows = {row["variant"]: row for row in json.loads(result_file.read_text())["rows"]}
    for row in rows.values():
        assert row["load"]["partly"] and 0 < row["load"]["loaded_bytes"] < row["load"]["model_bytes"], row
    kiln = rows["kiln"]
    assert kiln["psnr_db"] == "identical" or kiln["psnr_db"] >= 40
    memory = kiln["kiln"]["memory"]
    assert not memory["fits"] and memory["blocks_eager"] > 0 and not memory["cuda_graphs"], memory
    assert kiln["kiln"]["graphs"] >= 1 and kiln["kiln"]["fallback"] is None   # the resident blocks compiled
    log = (tmp_path / result_file.name.replace(".json", ".log")).read_text()
    assert f"Kiln's memory verdict: {memory['why']}" in log and "ComfyUI loaded " in log


def test_dynamic_vram_is_refused_off_cuda(capsys):
    from kiln.benchmarks import comfy_workflows

    with pytest.raises(SystemExit) as refused:
        comfy_workflows.main(["--comfyui", COMFYUI_PATH, "--model", "sd15", "--device", "cpu", "--dynamic-vram"])
    assert refused.value.code == 2 and "--dynamic-vram needs --device cuda" in capsys.readouterr().err
