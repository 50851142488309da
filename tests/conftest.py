import os

# Triton kernels run on CPU tensors through Triton's interpreter; it must be set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _no_grad_and_fresh_dynamo():
    """Kiln is an inference compiler: tests run like ComfyUI does, without autograd."""
    with torch.no_grad():
        yield

