"""The node's behaviour that needs no ComfyUI: declarations, option errors, the eager fallback, the line
it shows per compile."""
import pytest
import torch

import kiln
import kiln.loaded
import kiln.nodes
from kiln.compiler import OptionsError
from kiln.compiler.torch_compat import versions
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
    assert inputs["required"]["mode"][0] == list(kiln.compiler.MODES) == list(kiln.compiler.LOWERINGS)
    assert inputs["required"]["mode"][1]["default"] == "balanced"
    for mode, lowering in kiln.compiler.LOWERINGS.items():  # the tooltip says what each mode means
        assert f"{mode}: {lowering.description}" in inputs["required"]["mode"][1]["tooltip"]
    assert KilnCompileUNet.RETURN_TYPES == ("MODEL", "STRING")


def test_old_torch_passes_the_model_through_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(versions, "torch_version", lambda: (2, 3))
    model = FakePatcher()
    out, report = KilnCompileUNet().compile(model)
    assert out is model
    assert report.startswith("Kiln: running eagerly, nothing compiled: torch") and "older than 2.5" in report
    assert "running eagerly" in caplog.text


def test_compiler_import_failure_passes_the_model_through(monkeypatch):
    monkeypatch.setattr(kiln.loaded, "compiler", None)
    monkeypatch.setattr(kiln.loaded, "COMPILER_LOAD_ERROR", "Kiln's compiler could not load (ImportError: no custom_op)")
    model = FakePatcher()
    out, report = KilnCompileUNet().compile(model)
    assert out is model and "could not load (ImportError: no custom_op)" in report


def test_a_comfyui_without_model_wrappers_passes_the_model_through_and_says_which_version_is_needed():
    model = FakePatcher()  # no ComfyUI in this process: comfy.patcher_extension cannot import
    out, report = KilnCompileUNet().compile(model)
    assert out is model and "has no model wrappers" in report and "Kiln needs ComfyUI 0.3.7 or newer" in report


def test_nodes_import_only_the_compilers_public_api():
    """nodes/ never reaches around kiln.compiler's public names (no compat, kernels, backend...); besides
    them it reads the package's guarded compiler and the torch-free choices and events every layer shares."""
    import ast
    from pathlib import Path

    import kiln.compiler

    public = set(kiln.compiler.__all__)
    for path in Path(kiln.nodes.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:  # from .. / from ..x import
                assert node.module in ("compiler", "loaded", "choices", "events"), f"{path.name} imports ..{node.module}"
                if node.module == "compiler":
                    assert {a.name for a in node.names} <= public, f"{path.name}: {[a.name for a in node.names]}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "compiler":
                assert node.attr in public, f"{path.name} uses compiler.{node.attr}"


def test_no_node_module_imports_another():
    """Node modules import what they share (shared.py, plan_wrapper.py, quant_patcher.py), not each other."""
    import ast
    from pathlib import Path

    folder = Path(kiln.nodes.__file__).parent
    node_modules = {path.stem for path in folder.glob("*.py")
                    if path.stem != "__init__" and "NODE_CLASS_MAPPINGS = {" in path.read_text()}
    assert {"compile_unet", "compile_vae", "compile_controlnet", "cache_graph", "quantize_model"} <= node_modules
    for name in node_modules:
        imported = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {a.name for a in node.names}
        assert not imported & node_modules, f"{name} imports {sorted(imported & node_modules)}"


def test_bad_advanced_options_are_an_error_naming_the_key():
    with pytest.raises(OptionsError, match="unknown key\\(s\\) 'fullgrpah'"):
        KilnCompileUNet().compile(FakePatcher(), advanced='{"fullgrpah": true}')


def test_missing_triton_on_a_gpu_is_reported(monkeypatch):
    from kiln.compiler import kernel_note
    from kiln.kernels import _library

    monkeypatch.setattr(_library, "triton_available", lambda: False)
    monkeypatch.setattr("kiln.kernels.triton_available", lambda: False)
    assert "Triton is not installed" in kernel_note("cuda:0")
    assert kernel_note("cpu") == ""


def test_pin_shapes_input_is_declared_and_validated():
    from kiln.compiler.options.shape_policy import ShapePolicyError

    assert "pin_shapes" in KilnCompileUNet.INPUT_TYPES()["optional"]
    with pytest.raises(ShapePolicyError, match="'1000x1001': width and height must be multiples of 8"):
        KilnCompileUNet().compile(FakePatcher(), pin_shapes="1024x1024, 1000x1001")
    with pytest.raises(OptionsError, match="no effect in mode 'fast'"):
        KilnCompileUNet().compile(FakePatcher(), mode="fast", pin_shapes="1024x1024")
    # dynamic=false has no dynamic graph to pin shapes ahead of: an error, not pins silently never compiled
    with pytest.raises(OptionsError, match="shapes.pin and shapes.specialize need dynamic auto or true"):
        KilnCompileUNet().compile(FakePatcher(), dynamic="false", pin_shapes="1024x1024")
    # a workflow's widget text is untrusted: bounded as the advanced text is, and in what it pins
    with pytest.raises(ShapePolicyError, match=r"^shapes\.pin: the text is 70,000 characters long; the limit is 65,536"):
        KilnCompileUNet().compile(FakePatcher(), pin_shapes="1024x1024," * 7000)
    with pytest.raises(ShapePolicyError, match=r"^shapes\.pin: 9 pinned shapes, more than shapes\.max_variants=8"):
        KilnCompileUNet().compile(FakePatcher(), pin_shapes=", ".join(f"{8 * i}x512" for i in range(1, 10)))
    with pytest.raises(ShapePolicyError, match=r"^shapes\.pin: '65536x65536:64': width and height must be 8 to 16384"):
        KilnCompileUNet().compile(FakePatcher(), pin_shapes="65536x65536:64")


def test_a_compile_shows_as_one_line_the_guard_with_its_source_line():
    """TorchDynamo's recompile reason goes on with a user stack trace: the node (and `kiln queue`) shows
    the first line, the log and kiln.stats keep it whole."""
    from kiln.compiler.stats import GraphCompile

    reason = ("recompile: 1/0: ___check_type_id(kwargs['control'], 1), type=<class 'dict'>  # if control is not None"
              "  # openaimodel.py:366 in apply_control\nUser stack trace:\n  File \"model.py\", line 82, in forward")
    graph = GraphCompile(index=1, reason=reason, lowering="fx", input_shapes=[[2, 4, 8, 8]], nodes=9, rewrites={},
                         skipped={}, seconds=1.3, dynamic=True, capture_seconds=2.0)
    assert graph.event().line() == ("Kiln compiled graph 1 in 3.3s (fx, dynamic shapes): " + reason.splitlines()[0])
    first = GraphCompile(**{**graph.__dict__, "index": 0, "reason": "first compile", "dynamic": False})
    assert first.event().line() == "Kiln compiled graph 0 in 3.3s (fx, static shapes): first compile"
    assert "User stack trace" in graph.line()  # what the log says
    region = GraphCompile(**{**first.__dict__, "region": "ResBlock#2"})
    assert region.event().line() == "Kiln compiled graph 0 in 3.3s (fx, static shapes) for region ResBlock#2: first compile"
    assert (region.event().seconds, region.event().variant) == (3.3, "fx, static shapes")  # what `kiln queue` adds up
