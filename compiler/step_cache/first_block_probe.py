"""The first block's residual, for the step cache's method first_block (compiler/step_cache/decision.py).

`first_block_of(model)` finds the first of the model's blocks (compiler/regional/blocks.py's walk, in model
order: SD1.5's first ResBlock, Flux's first double block); `first_block_probed(cache, block)`
observes it for the duration of one model call and hands its residual, output minus input, to
`cache.probe`, which may end the call there when the step is skipped. The observer sits where Kiln
routes a block to its compiled region (module_calls.calls_observed): by blocks the region stays compiled
and the probe runs in the eager glue after it. A model compiled whole (core's compile node, Kiln's
`compile_unit: whole`) runs its blocks inside one graph, where nothing observes them: the step
cache then refuses the call with what to do instead.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ..torch_compat import module_calls
from ..regional.blocks import find_blocks
from .decision import StepCache, StepCacheError


def first_block_of(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """(path, block): the first block of `model`; StepCacheError if it has none."""
    blocks = find_blocks(model)
    if not blocks:
        raise StepCacheError(f"step cache: method first_block needs a model made of blocks, and "
                             f"{type(model).__name__} has none Kiln can find; use method reuse")
    return blocks[0]


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    return None


def first_tensor_input(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The block's first tensor input, the hidden state it updates (ResBlock(x, emb), Flux's
    block(img=..., txt=...), diffusers' block(hidden_states, temb))."""
    return _first_tensor((*args, *kwargs.values()))


def residual(out: Any, hidden_in: Optional[torch.Tensor]) -> torch.Tensor:
    """The block's residual: its first output tensor minus its hidden state as it came in, where their
    shapes and dtypes match; the output itself where they do not (a block that changes the width)."""
    hidden = _first_tensor(out)
    if hidden is None:
        raise StepCacheError(f"step cache: method first_block, but the model's first block returned "
                             f"{type(out).__name__} with no tensor in it; use method reuse")
    if hidden_in is not None and hidden_in.shape == hidden.shape and hidden_in.dtype == hidden.dtype:
        return hidden - hidden_in
    return hidden


@contextlib.contextmanager
def first_block_probed(cache: StepCache, block: torch.nn.Module):
    """While inside, every call of `block` hands its residual to `cache.probe` (see the module docstring)."""
    def before(args, kwargs):
        hidden = first_tensor_input(args, kwargs)
        # a copy: a block may update its input in place (ComfyUI's Flux blocks add to `img`)
        return None if hidden is None or not cache.probing else hidden.clone()

    def after(out, hidden_in):
        if hidden_in is not None:
            cache.probe(residual(out, hidden_in))
        return out

    with module_calls.calls_observed(block, before, after):
        yield
