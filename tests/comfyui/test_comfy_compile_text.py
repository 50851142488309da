"""Kiln › Compile UNet shows each compile and new shape variant on itself in ComfyUI's UI (progress
text to its node id), and sends each compile's record (events.py), which `kiln queue` reads. Runs when
COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")

from kiln.nodes import plan_wrapper  # noqa: E402
from comfy_testing import compile_unet, make_tiny_sd15_patcher, sample  # noqa: E402


def test_compile_unet_shows_its_compiles_then_nothing_for_a_reused_shape(monkeypatch):
    shown, sent = [], []
    monkeypatch.setattr(plan_wrapper, "show_text", lambda node, text: shown.append((node, text)))
    monkeypatch.setattr(plan_wrapper, "send_events", lambda node, events: sent.extend((node, e) for e in events))
    model, _ = compile_unet(make_tiny_sd15_patcher(seed=1), mode="fast", unique_id="11")
    sample(model, steps=1)
    assert shown and {node for node, _ in shown} == {"11"} == {node for node, _ in sent}
    lines = [line for _, text in shown for line in text.splitlines()]
    events = [event for _, event in sent]
    assert [line for line in lines if line.startswith("Kiln compiled graph")] == [event.line() for event in events]
    assert events[0].lowering == "fx" and events[0].reason == "first compile"
    assert events[0].region == "ResBlock#1" and lines[0].startswith("Kiln compiles by blocks: 17 blocks in 11 regions")
    shown.clear()
    sample(model, steps=1)  # the same shape again: nothing compiled, nothing shown
    assert shown == [] and len(sent) == len(events)
