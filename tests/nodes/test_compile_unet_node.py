"""The node's behaviour that needs no ComfyUI: declarations, option errors, the eager fallback."""
import pytest
import torch

from kiln.compiler import OptionsError, compat
from kiln.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from kiln.nodes.compile_unet import KilnCompileUNet


class FakePatcher:
    """Just enough of ModelPatcher for the paths that return before cloning."""

    def __init__(self):
        self.diffusion_model = torch.nn.Linear(2, 2)

    def get_model_object(self, name):
        assert name == "diffusion_model"
        return self.diffusion_model


def test_node_is_registered_with_its_display_name():
    assert NODE_CLASS_MAPPINGS["KilnCompileUNet"] is KilnCompileUNet
    assert NODE_DISPLAY_NAME_MAPPINGS["KilnCompileUNet"] == "Kiln › Compile UNet"
    inputs = KilnCompileUNet.INPUT_TYPES()
    assert inputs["required"]["mode"][0] == ["fast", "balanced", "max"]
    assert inputs["required"]["mode"][1]["default"] == "balanced"
    assert KilnCompileUNet.RETURN_TYPES == ("MODEL", "STRING")


def test_old_torch_passes_the_model_through_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 3))
    model = FakePatcher()
    out, report = KilnCompileUNet().compile(model)
    assert out is model
    assert report.startswith("Kiln: running eagerly, nothing compiled: torch") and "older than 2.5" in report
    assert "running eagerly" in caplog.text


def test_compiler_import_failure_passes_the_model_through(monkeypatch):
    import kiln

    monkeypatch.setattr(kiln, "IMPORT_ERROR", "ImportError: no torch.library.custom_op")
    model = FakePatcher()
    out, report = KilnCompileUNet().compile(model)
    assert out is model and "could not load (ImportError: no torch.library.custom_op)" in report


def test_bad_advanced_options_are_an_error_naming_the_key():
    with pytest.raises(OptionsError, match="unknown key\\(s\\) 'fullgrpah'"):
        KilnCompileUNet().compile(FakePatcher(), advanced='{"fullgrpah": true}')


def test_missing_triton_on_a_gpu_is_reported(monkeypatch):
    from kiln.kernels import _library
    from kiln.nodes.compile_unet import kernel_note

    monkeypatch.setattr(_library, "triton_available", lambda: False)
    monkeypatch.setattr("kiln.kernels.triton_available", lambda: False)
    assert "Triton is not installed" in kernel_note("cuda:0")
    assert kernel_note("cpu") == ""


def test_pin_shapes_input_is_declared_and_validated():
    from kiln.compiler.shape_policy import ShapePolicyError

    assert "pin_shapes" in KilnCompileUNet.INPUT_TYPES()["optional"]
    with pytest.raises(ShapePolicyError, match="'1000x1001': width and height must be multiples of 8"):
        KilnCompileUNet().compile(FakePatcher(), pin_shapes="1024x1024, 1000x1001")
    with pytest.raises(OptionsError, match="no effect in mode 'fast'"):
        KilnCompileUNet().compile(FakePatcher(), mode="fast", pin_shapes="1024x1024")
