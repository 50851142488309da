"""CUDA timing helpers that reach into torch's private API: a spin kernel that keeps the GPU busy.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations

import torch


def gpu_spin(cycles: int) -> None:
    """Queue a kernel on the current stream that spins for `cycles` GPU clock cycles and does nothing
    else (`torch.cuda._sleep`, checked: torch 2.5 - 2.13). While it runs the host issues the work
    after it, so events recorded after it time the GPU's own work, not the host's issuing."""
    torch.cuda._sleep(int(cycles))
