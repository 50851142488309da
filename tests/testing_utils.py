"""Helpers shared by the tests (tests/ is on pytest's pythonpath)."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute difference relative to the reference's max magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
