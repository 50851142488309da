"""Start-up matrix: whatever is wrong with the environment, `import kiln` works, ComfyUI's nodes
register, and a Kiln node says why it runs eagerly. Each case runs in a fresh Python process (the
breakage must be in place before Kiln is imported, as it would be in a user's ComfyUI)."""
import subprocess
import sys
import textwrap

ALL_NODES = "NODES ['KilnCacheGraph', 'KilnCompileControlNet', 'KilnCompileUNet', 'KilnCompileVAE', 'KilnLoadQuantizedModel', 'KilnQuantizeModel', 'KilnSaveQuantizedModel', 'KilnStepCache']"

HEADER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s: %(message)s")
"""

NODE_CALL = """
import torch
class Patcher:  # what the node touches before it would clone a ModelPatcher
    load_device = "cpu"
    def get_model_object(self, name):
        return torch.nn.Linear(2, 2)
from kiln.nodes.compile_unet import KilnCompileUNet
patcher = Patcher()
out, report = KilnCompileUNet().compile(patcher)
print("NODES", sorted(kiln.NODE_CLASS_MAPPINGS))
from kiln.nodes.cache_graph import KilnCacheGraph
cached, cache_report = KilnCacheGraph().cache(patcher, cache_dir=sys.argv[1] if len(sys.argv) > 1 else "/nonexistent")
print("PASSED THROUGH", out is patcher and cached is patcher)
print("CACHE REPORT", cache_report)
print("REPORT", report)
"""

COMPILE_CALL = """
import torch
module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
compiled = kiln.compile(module, mode="fast")
x = torch.randn(3, 8)
with torch.no_grad():
    print("MATCHES EAGER", torch.allclose(compiled(x), module(x)), "GRAPHS", kiln.stats(compiled).compile_count)
print("CUDA NOTE", kiln.compiler.kernel_note("cuda:0"))
"""


def _run(code: str, tmp_path, fake_comfyui: bool = False) -> str:
    env_setup = ""
    if fake_comfyui:  # a ComfyUI from before model wrappers: `comfy` imports, comfy.patcher_extension does not
        (tmp_path / "comfy").mkdir()
        (tmp_path / "comfy" / "__init__.py").write_text("")
        (tmp_path / "comfyui_version.py").write_text('__version__ = "0.3.6"\n')
        env_setup = f"sys.path.insert(0, {str(tmp_path)!r}); import comfy\n"
    script = HEADER + env_setup + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_no_triton(tmp_path):
    out = _run("sys.modules['triton'] = None  # not installed\nimport kiln, kiln.compiler\n" + COMPILE_CALL, tmp_path)
    assert "MATCHES EAGER True GRAPHS 1" in out
    assert "CUDA NOTE Triton is not installed: Kiln's kernels run their torch references" in out


def test_a_triton_that_fails_to_import(tmp_path):
    broken = """
class BrokenTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            raise RuntimeError("libcuda.so: cannot open shared object file")
sys.meta_path.insert(0, BrokenTriton())
import kiln, kiln.compiler
"""
    out = _run(broken + COMPILE_CALL, tmp_path)
    # torch's own TorchDynamo cannot load with such a Triton (it catches only ImportError): the model
    # runs eagerly, and the log says why
    assert "MATCHES EAGER True GRAPHS 0" in out
    assert "cannot set up the compile (RuntimeError: libcuda.so: cannot open shared object file)" in out
    assert "runs eagerly from now on" in out
    assert "CUDA NOTE Triton is not installed" in out


def test_a_triton_that_fails_to_import_with_an_import_error(tmp_path):
    broken = """
class BrokenTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            raise ImportError("libcuda.so.1: cannot open shared object file")
sys.meta_path.insert(0, BrokenTriton())
import kiln, kiln.compiler
"""
    out = _run(broken + COMPILE_CALL, tmp_path)
    assert "MATCHES EAGER True GRAPHS 1" in out
    assert "CUDA NOTE Triton is not installed" in out


def test_a_torch_older_than_kiln_supports(tmp_path):
    out = _run("import torch; torch.__version__ = '2.3.1'\nimport kiln\n" + NODE_CALL, tmp_path, fake_comfyui=True)
    assert ALL_NODES in out and "PASSED THROUGH True" in out
    assert "REPORT Kiln: running eagerly, nothing compiled: torch 2.3.1 is older than 2.5" in out


def test_a_comfyui_without_the_extension_points_kiln_needs(tmp_path):
    out = _run("import kiln\n" + NODE_CALL, tmp_path, fake_comfyui=True)
    # said once at start-up, with the version needed, and again in the node's report
    assert "LOG kiln: Kiln: this ComfyUI (version 0.3.6) has no model wrappers" in out
    assert "Kiln needs ComfyUI 0.3.7 or newer" in out
    assert ALL_NODES in out and "PASSED THROUGH True" in out
    assert "REPORT Kiln: running eagerly, nothing compiled: this ComfyUI (version 0.3.6) has no model wrappers" in out


def test_a_compiler_that_cannot_load(tmp_path):
    broken = """
class BrokenCompiler:  # e.g. a torch whose torch.library lacks what Kiln's kernels register with
    def find_spec(self, name, path=None, target=None):
        if name == "kiln.compiler":
            raise ImportError("cannot import name 'custom_op' from 'torch.library'")
sys.meta_path.insert(0, BrokenCompiler())
import kiln
"""
    out = _run(broken + NODE_CALL, tmp_path, fake_comfyui=True)
    assert "Kiln's compiler could not load (ImportError: cannot import name 'custom_op'" in out
    assert ALL_NODES in out and "PASSED THROUGH True" in out
    assert "REPORT Kiln: running eagerly, nothing compiled: Kiln's compiler could not load (ImportError" in out


def test_outside_comfyui_nothing_is_registered_and_nothing_is_said(tmp_path):
    out = _run("import kiln\nprint('NODES', kiln.NODE_CLASS_MAPPINGS)\n", tmp_path)
    assert "NODES {}" in out and "LOG" not in out
