"""What is dynamic from the first compile: the batch dimension, and the latent's resolution.

ComfyUI changes the batch the diffusion model sees all the time (batch size x CFG, cond and
uncond run together or apart, areas, ControlNet). Marking the batch dimension dynamic before the
first compile makes one graph serve every batch of 2 or more: no recompile when it changes and
no warm-up trick, and since the graph computes every expand/view/interpolate size from the
symbolic batch, no size is left hard-coded from the batch it was traced at (onediff's
`(4, 1280) != (2, 1280)` bug). A batch of 1 gets its own graph (TorchDynamo specialises sizes 0
and 1); Kiln's stats name that recompile's reason like any other.

The latent's height and width (the last two dims of the first 4-D or 5-D input) are marked too,
so a new resolution runs on the same graph with no compile, and so are those of every other 4-D or
5-D input of the same batch or of a batch of 1 (broadcast), nested ones included: ControlNet's
residuals (ComfyUI passes them as `control={"input": [...], "middle": [...], "output": [...]}`,
diffusers as `down_block_additional_residuals`), each at the resolution of the block it is added
to, and a ControlNet's hint image (batch 1 when one hint serves the whole batch). Left static, one
residual added to the latent's dynamic activations pins the whole graph to the size it was traced
at (seen on ComfyUI's UNet: with a ControlNet applied, every new resolution recompiled).

A model whose code branches on the size (diffusers' UNet checks that it divides by its upsampling
factor) gets one more graph for the other branch, with TorchDynamo's reason in the stats. Which
resolutions deserve static kernels of their own is the shape manager's business
(compiler/shapes/shape_manager.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..host_inputs import host_inputs
from ..torch_compat import dynamo, fx_graphs, module_calls


def tensors_in(value, depth: int = 2):
    """Tensors in an argument: itself, or inside dicts/lists/tuples up to `depth` levels (a model's
    added_cond_kwargs and ComfyUI's control dict of residual lists: two; a block's rotary (cos, sin)
    tuple, ComfyUI's transformer_options). The bound also ends a container that holds itself."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth - 1)
    elif depth and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth - 1)


def activation_indices(gm: torch.fx.GraphModule) -> list[int]:
    """The positions of a captured graph's inputs that are activations, not weights (TorchDynamo's
    guards fix the weights; the shape manager and mode fast's recordings key by the activations)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if not fx_graphs.is_weight(n)]


def shapes_key(args, indices) -> tuple:
    """The shape signature of one call of a graph: for each input at `indices` (its activations, not
    its weights, which TorchDynamo's guards fix), a tensor's shape and strides, or the value itself."""
    return tuple((tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in (args[i] for i in indices))


def contiguous_inputs(args, kwargs):
    """The call's tensor arguments, dense and not views. Callers pass slices too (a VAE's tiles, the
    crops of ComfyUI's area conditioning): TorchDynamo guards on their strides, so each new slicing
    would recompile; a copy of a slice costs far less than the model run on it. A dense tensor in
    another layout (channels-last, a transpose) is left as it is. A dense view (a Linear's 3-D output
    is one) is passed detached from its base, with the same memory: TorchDynamo guards on a view's
    base, so a view in one call and a plain tensor in the next would recompile (seen between two
    identical blocks, the first fed by eager glue). A contiguous tensor whose size-1 dimension has a
    stride other than a fresh tensor's (a slice of a batch of 1 along its tokens: diffusers' Flux
    single blocks pass each other such slices, the first one a fresh tensor) gets a fresh tensor's
    strides over the same memory: TorchDynamo guards on that stride too, and recompiled the block."""
    def fix(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_contiguous():
            if 1 in value.shape and type(value) is torch.Tensor:  # only a size-1 dimension can differ
                strides = _contiguous_strides(value.shape)
                if value.stride() != strides:
                    return value.as_strided(value.shape, strides).detach()
        elif not _dense(value):
            return value.contiguous()
        return value.detach() if module_calls.is_view(value) else value

    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}


def input_shapes(args, kwargs) -> tuple:
    """The shapes of a call's tensor arguments, positional then keyword (by name): what a model call's
    CUDA graphs are counted by (compiler/shapes/cuda_graph_budget.py)."""
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    shapes += [tuple(kwargs[k].shape) for k in sorted(kwargs) if isinstance(kwargs[k], torch.Tensor)]
    return tuple(shapes)


def _contiguous_strides(shape: torch.Size) -> tuple:
    """The strides of a fresh (contiguous) tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense(tensor: torch.Tensor) -> bool:
    """No gaps between its elements, in whatever dimension order (contiguous, channels-last, a transpose)."""
    expected = 1
    for stride, size in sorted(zip(tensor.stride(), tensor.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def model_latent(args, kwargs) -> Optional[torch.Tensor]:
    """A model call's latent: its first 4-D or 5-D (video) input tensor; None if it has none (a DiT
    given packed tokens)."""
    return next((t for v in (*args, *kwargs.values()) for t in tensors_in(v) if t.dim() in (4, 5)), None)


def mark_batch_and_resolution_dynamic(args, kwargs) -> None:
    """Before a call of a compiled model: every input tensor whose first dimension is the batch
    (that of the first tensor argument) gets a dynamic first dimension; the latent (`model_latent`)
    and every other 4-D or 5-D input of its batch or of a batch of 1 (ControlNet residuals, a hint
    image) a dynamic height and width."""
    inputs = [t for v in (*args, *kwargs.values()) for t in tensors_in(v)]
    latent = model_latent(args, kwargs)
    if latent is not None:
        for tensor in inputs:
            if tensor is latent or (tensor.dim() in (4, 5) and tensor.shape[0] in (latent.shape[0], 1)):
                _allow_any_resolution(tensor)
    batch = next((t.shape[0] for t in inputs if t.dim() > 0), None)
    if batch is None or batch < 2:
        return
    for tensor in inputs:
        if tensor.dim() > 0 and tensor.shape[0] == batch:
            dynamo.allow_any_size(tensor, 0)


def _allow_any_resolution(tensor: torch.Tensor) -> None:
    for dim in (tensor.dim() - 2, tensor.dim() - 1):
        if tensor.shape[dim] > 1:
            dynamo.allow_any_size(tensor, dim)


def mark_schedule_dynamic(args, kwargs) -> None:
    """The length of a sampler's schedule that the host passes down in an argument (compiler/host_inputs.py:
    ComfyUI's sigmas) is dynamic: it is the step count, and changing it must not recompile."""
    host = host_inputs()
    for value in (*args, *kwargs.values()):
        sigmas = host.schedule_in(value)
        if sigmas is not None:
            dynamo.allow_any_size(sigmas)
