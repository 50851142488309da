"""How a rewritten FX graph becomes callable, as its mode's `Lowering` (compiler/options/modes.py) says:
run as captured (mode fast; with CUDA graphs, one recording per shape signature), or lowered by
Inductor (balanced; max with the max-autotune preset).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import torch

from .. import cpu
from ..torch_compat import cuda_graph_trees, dynamo, fx_graphs, inductor
from ..options.modes import Lowering
from ..shapes.inputs import activation_indices, shapes_key

log = logging.getLogger("kiln")


def lower_graph(lowering: Lowering, gm, example_inputs, options, device: str, cache_tag: str = ""):
    """(callable, name): the graph lowered for `device` with `options` (a CompileOptions), as its mode's
    `lowering` says (compiler/options/modes.py). `cache_tag` goes into Inductor's FX graph cache key
    (Kiln's pass and kernel sources)."""
    cuda_graphs = bool(options.cuda_graphs and device == "cuda")
    if not lowering.uses_inductor:
        if cuda_graphs:
            return CudaGraphsPerShape(gm), "fx + cudagraphs"
        return gm.forward, "fx"
    preset = lowering.inductor_preset
    config = inductor.inductor_mode_options(preset) if preset else {}
    config["triton.cudagraphs"] = cuda_graphs
    config.update(options.inductor)
    with inductor.inductor_config_patch(config), inductor.cache_key_tag(cache_tag):
        compiled = (cpu.inductor_compile(device) or dynamo.lookup_backend("inductor"))(gm, example_inputs)
    name = "inductor" + (f" {preset}" if preset else "") + (" + cudagraphs" if cuda_graphs else "")
    return compiled, name


class LoweringFailed(RuntimeError):
    """A lowering made on a graph's first call at a new signature failed (its cause is chained): it
    counts as a failed compile, so the graph's model or region runs eagerly, said with the reason."""


class CudaGraphsPerShape:
    """Mode fast's CUDA graphs, one recording per shape signature. torch's `cudagraphs` backend keys
    its recordings by the graph's integer inputs, and a size that reaches the graph only through a
    tensor (often the batch) is not one: a new batch was copied into the first batch's buffers and
    failed ("The size of tensor a (2) must match the size of tensor b (4)", seen on an H200). Here a
    `cudagraphs` callable is made per signature of the activations (shapes_key: the non-weight
    inputs' shapes and strides, as the shape manager keys them), on that signature's first call, and
    only where Kiln's bound on recordings admits it (cuda_graph_trees.cuda_graph_capture_allowed, the question
    Inductor asks before recording); a signature refused runs the graph as captured, without CUDA
    graphs. The callable is made from the graph with the signature's sizes written in
    (graph_for_signature). A failure to make one raises LoweringFailed."""

    def __init__(self, gm):
        self.gm = gm
        self.activations = activation_indices(gm)
        self.by_signature: dict[tuple, Recording] = {}

    def __call__(self, *args):
        signature = shapes_key(args, self.activations)
        if not cuda_graph_trees.cuda_graph_capture_allowed(signature):
            return self.gm(*args)
        recording = self.by_signature.get(signature)
        if recording is None:
            start = time.perf_counter()
            try:
                sized, takes = graph_for_signature(self.gm, args, self.activations)
                recording = Recording(dynamo.lookup_backend("cudagraphs")(sized, [args[i] for i in takes]), takes)
            except Exception as exc:
                raise LoweringFailed(f"CUDA graphs for a new shape could not be made: {type(exc).__name__}: {exc}") from exc
            self.by_signature[signature] = recording
            log.info("Kiln: CUDA graphs prepared for shape signature %d of this graph in %.1fs",
                     len(self.by_signature), time.perf_counter() - start)
        return recording.run(*[args[i] for i in recording.takes])


class Recording(NamedTuple):
    """One shape signature's CUDA-graphed callable and the positions of the graph's inputs it takes."""
    run: Callable
    takes: list[int]


def _value(value):
    """A size written into a graph: the value itself (a node, so that a method called on the size
    stays valid code)."""
    return value


def graph_for_signature(gm: torch.fx.GraphModule, args, keyed: list[int]) -> tuple[torch.fx.GraphModule, list[int]]:
    """A copy of `gm` in which each input that is not a tensor (a size TorchDynamo passes as a symbolic
    integer) is replaced by its value in `args`, and the positions of the inputs the copy still takes.
    Only inputs at `keyed` (the positions the signature is keyed by) may be written in, so that a
    recording made from the copy serves exactly its signature. torch's `cudagraphs` backend needs
    this: it traces the graph it is given with the call's values and then reads a tensor or symbol
    from every input of the traced graph, which a plain integer input does not give it
    ("KeyError: 'fake_result'" for every region of a dynamic graph, seen on an H100)."""
    sized = fx_graphs.copy_graph_module(gm)
    placeholders = sized.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(args):
        raise ValueError(f"the graph takes {len(placeholders)} inputs, the call gave {len(args)}")
    takes = []
    for position, (node, value) in enumerate(zip(placeholders, args)):
        if isinstance(value, torch.Tensor):
            takes.append(position)
            continue
        if position not in keyed:
            raise ValueError(f"input {position} ({node.name}) is not a tensor and not part of the shape signature")
        with sized.graph.inserting_after(placeholders[-1]):
            written = sized.graph.call_function(_value, (value,))
        node.replace_all_uses_with(written)
        sized.graph.erase_node(node)
    sized.recompile()
    return sized, takes
