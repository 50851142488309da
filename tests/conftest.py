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
def _plain_host_inputs():
    """Every test starts with the compiler reading block arguments as plain PyTorch passes them
    (compiler/host_inputs.py): importing Kiln's nodes registers ComfyUI's conventions for the process,
    which must not leak into tests of the plain compiler. `comfy_host` asks for ComfyUI's."""
    from kiln.compiler import HostInputs, host_inputs, use_host_inputs

    before = host_inputs()
    use_host_inputs(HostInputs())
    yield
    use_host_inputs(before)


@pytest.fixture
def comfy_host():
    """The compiler reads block arguments as ComfyUI passes them (nodes/block_inputs.py), as in a server."""
    from kiln.compiler import use_host_inputs
    from kiln.nodes.block_inputs import ComfyBlockInputs

    use_host_inputs(ComfyBlockInputs())
    yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_per_module():
    """Every test module starts with empty TorchDynamo caches: the tests compile the same model
    classes (hence the same forward code objects) many times, and TorchDynamo's per-code-object
    recompile limit would otherwise be reached across modules."""
    torch._dynamo.reset()
    yield
