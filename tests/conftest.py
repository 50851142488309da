import atexit
import os
import shutil
import tempfile

# Triton kernels run on CPU tensors through Triton's interpreter; it must be set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Kiln's cache signing key lives in the user's configuration folder: the tests (and the processes
# they start) make theirs in a folder of their own, and never see a server's KILN_CACHE_DIR.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="kiln-tests-config-")
atexit.register(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], True)
os.environ.pop("KILN_CACHE_DIR", None)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _no_grad():
    """Kiln is an inference compiler: tests run like ComfyUI does, without autograd."""
    with torch.no_grad():
        yield



@pytest.fixture(autouse=True)
def _no_background_cpu_probe(monkeypatch):
    """Every test starts with the cache's CPU-probe bookkeeping of a fresh process, and none starts
    Inductor's probe in a background child because an earlier test probed (compiler/cache/cpu_probe.py):
    tests/cache/test_cpu_probe.py starts fake ones, and test_compile_cache.py a real one in a process
    of its own."""
    from kiln.compiler import compat
    from kiln.compiler.cache import cpu_probe

    def no_child(cache_dir):
        raise OSError("no background probe in the unit tests")

    for name, value in (("_looked", set()), ("_programs", {}), ("_building", [])):
        monkeypatch.setattr(cpu_probe, name, value)
    monkeypatch.setattr(compat, "start_cpu_probe_child", no_child)


@pytest.fixture(autouse=True)
def _no_cpu_header_built_ahead(monkeypatch):
    """No test's CPU lowering starts Inductor's header build in a background thread (compiler/backend/lowering.py,
    build_cpu_header_ahead), whose log lines and gcc would land in whichever test runs next; Inductor
    builds the header itself. tests/compiler/test_lowering.py and tests/cache/test_headers.py turn it back on
    where they test it, and the processes tests/cache/test_compile_cache.py starts run it as a user's would."""
    from kiln.compiler.backend import lowering

    monkeypatch.setattr(lowering, "_header_asked", True)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_per_module():
    """Every test module starts with empty TorchDynamo caches: the tests compile the same model
    classes (hence the same forward code objects) many times, and TorchDynamo's per-code-object
    recompile limit would otherwise be reached across modules."""
    torch._dynamo.reset()
    yield
