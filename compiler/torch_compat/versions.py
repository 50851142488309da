"""The torch versions Kiln runs on.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations

from typing import Optional

import torch


MIN_TORCH = (2, 5)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_version_problem() -> Optional[str]:
    """Why this torch cannot run Kiln's compiler, or None. Checked: 2.5 - 2.14."""
    if torch_version() < MIN_TORCH:
        return (f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}: Kiln's compiler needs "
                "torch.library.custom_op and TorchDynamo's inlined nn.Module parameters; update torch")
    return None
