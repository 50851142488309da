"""Which CUDA allocator the process runs, and what that means for Kiln's recordings.

Rules (torch's allocator backends, `torch.cuda.get_allocator_backend()`: "native" or
"cudaMallocAsync"; ComfyUI selects cudaMallocAsync by default unless started with
`--disable-cuda-malloc`):

- torch's own CUDA graph trees (`mode="reduce-overhead"`, Inductor's `triton.cudagraph_trees`) check
  a private pool's live blocks with `checkPoolLiveAllocations`, which only the native allocator
  implements; under cudaMallocAsync they fail with "cudaMallocAsync does not yet support
  checkPoolLiveAllocations". Kiln's whole-call recordings never ask that: they use
  `torch.cuda.CUDAGraph` directly, whose capture the cudaMallocAsync backend supports (its source
  states it is designed to be safe for CUDA graph capture: allocations made while capturing become
  the graph's own).
- Under cudaMallocAsync a private memory pool given to a capture is not where the graph's memory
  comes from, so recordings cannot share one pool: each holds its own activations. MEMORY_NOTE says
  so, once, with what to do for shared pools.
"""
from __future__ import annotations

import torch

NATIVE = "native"
MALLOC_ASYNC = "cudaMallocAsync"
MEMORY_NOTE = ("the CUDA allocator is cudaMallocAsync (ComfyUI's default): Kiln's recordings work under it, but each "
               "holds its own activation memory instead of sharing one pool; start ComfyUI with --disable-cuda-malloc "
               "(or set PYTORCH_CUDA_ALLOC_CONF=backend:native) for recordings that share one pool")


def allocator_backend() -> str:
    """torch's CUDA allocator backend ("native" where CUDA is not initialised or not built in)."""
    if not torch.cuda.is_available():
        return NATIVE
    return torch.cuda.get_allocator_backend()


def shares_pool(backend: str) -> bool:
    """Recordings made with one private pool share its memory under `backend`."""
    return backend == NATIVE


def allocator_note(backend: str) -> str:
    """What a user should know about recordings under `backend` ("" for the native allocator)."""
    return "" if shares_pool(backend) else MEMORY_NOTE


__all__ = ["allocator_backend", "shares_pool", "allocator_note", "NATIVE", "MALLOC_ASYNC", "MEMORY_NOTE"]
