"""benchmarks/step_cache_server.py without a server: the prompts it queues and the times it reads
(tests/comfyui/test_comfy_workflows.py runs it against a real one)."""
import json

import pytest

from kiln.benchmarks import step_cache_server as bench
from kiln.choices import DEFAULT_STEP_CACHE_METHOD, METHOD_THRESHOLD, STEP_CACHE_SETTINGS

BASE = json.loads(bench.WORKFLOW.read_text())
EVERY_NODE = {name: {} for name in ("KilnStepCache", "KilnCompileUNet", "EasyCache", "TorchCompileModel")}


def test_each_setting_puts_its_chain_between_the_checkpoint_and_the_sampler():
    rows = {(group, setting): chain for group, setting, chain in bench.settings(EVERY_NODE, "fast")}
    chain = rows[("kiln compile", "kiln first_block default")]
    out = bench.prompt(BASE, chain, "digits.safetensors", steps=30, seed=13)
    assert bench.COMPILE not in out and bench.CACHE not in out
    assert out["chain0"]["class_type"] == "KilnCompileUNet" and out["chain0"]["inputs"]["model"] == [bench.CHECKPOINT, 0]
    assert out["chain0"]["inputs"]["mode"] == "fast"
    defaults = {name: default for name, (default, _) in STEP_CACHE_SETTINGS.items()}   # the node's own defaults
    assert out["chain1"]["inputs"] == {**defaults, "method": "first_block", "threshold": METHOD_THRESHOLD,
                                       "model": ["chain0", 0]}
    sampler = out[bench.SAMPLER]["inputs"]
    assert sampler["model"] == ["chain1", 0] and (sampler["seed"], sampler["steps"], sampler["cfg"]) == (13, 30, 4.0)
    assert out[bench.POSITIVE]["inputs"]["text"] == "a handwritten digit 3" and out[bench.NEGATIVE]["inputs"]["text"] == ""
    assert out[bench.CHECKPOINT]["inputs"]["ckpt_name"] == "digits.safetensors"
    assert bench.prompt(BASE, [], "d", 20, 0)[bench.SAMPLER]["inputs"]["model"] == [bench.CHECKPOINT, 0]
    assert BASE[bench.CACHE]["class_type"] == "KilnStepCache"   # the workflow is as the bench reads it


def test_every_kiln_setting_is_a_method_at_the_defaults_the_default_method_first():
    rows = bench.settings(EVERY_NODE, "fast")
    kiln = [(group, setting) for group, setting, _ in rows if setting.startswith("kiln")]
    assert kiln[0] == ("eager", f"kiln {DEFAULT_STEP_CACHE_METHOD} default")
    assert all(setting.endswith(" default") for _, setting in kiln)


def test_settings_the_server_lacks_are_left_out():
    only_kiln = {"KilnStepCache": {}, "KilnCompileUNet": {}}
    groups = {(group, setting) for group, setting, _ in bench.settings(only_kiln, "fast")}
    assert ("eager", "no cache") in groups and ("kiln compile", "kiln reuse default") in groups
    assert not any("easycache" in setting or group == "core compile" for group, setting in groups)


def test_the_time_is_the_servers_own_from_start_to_success():
    record = {"status": {"messages": [["execution_start", {"timestamp": 1000}], ["execution_cached", {}],
                                      ["execution_success", {"timestamp": 3500}]]}}
    assert bench.execution_seconds(record) == 2.5
    with pytest.raises(ValueError, match="no execution_start and execution_success"):
        bench.execution_seconds({"status": {"messages": [["execution_start", {"timestamp": "x"}]]}})
