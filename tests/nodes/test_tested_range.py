"""The ComfyUI versions Kiln is tested on: one constant, the same as pyproject.toml's requires-comfyui, and the
start-up line that says where the running ComfyUI stands against it."""
import logging
import pathlib
import tomllib

from kiln.nodes.plan_wrapper import TESTED_COMFYUI, comfyui_range_note

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pyproject_requires_the_oldest_tested_comfyui():
    comfy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["comfy"]
    assert comfy["requires-comfyui"] == f">={TESTED_COMFYUI[0]}"


def test_the_readme_states_the_tested_range():
    oldest, newest = TESTED_COMFYUI
    assert f"ComfyUI {oldest} to {newest}" in (ROOT / "README.md").read_text()


def test_inside_the_range_is_an_info_line():
    assert comfyui_range_note("0.8.0") == (logging.INFO, "Kiln on ComfyUI 0.8.0; Kiln is tested on ComfyUI 0.8.0 to 0.33.0")
    assert comfyui_range_note("0.33.0")[0] == logging.INFO
    assert comfyui_range_note("0.10.2")[0] == logging.INFO  # compared as numbers, not as text


def test_older_than_the_oldest_tested_is_a_warning():
    level, line = comfyui_range_note("0.3.60")
    assert level == logging.WARNING
    assert line.startswith("Kiln on ComfyUI 0.3.60, older than 0.8.0: Kiln is tested on ComfyUI 0.8.0 to 0.33.0")


def test_newer_or_unknown_is_said_not_refused():
    assert comfyui_range_note("0.38.1") == (
        logging.INFO, "Kiln on ComfyUI 0.38.1, newer than Kiln's tests have seen; Kiln is tested on ComfyUI 0.8.0 to 0.33.0")
    assert comfyui_range_note("unknown")[1].startswith("Kiln on a ComfyUI of unknown version 'unknown'")
    assert comfyui_range_note("0.8.0rc1")[0] == logging.INFO
