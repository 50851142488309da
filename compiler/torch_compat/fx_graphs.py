"""FX graphs as TorchDynamo captures them: fake values, symbolic sizes, weights, copies.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations


import torch


def fake_value(node: torch.fx.Node):
    """The fake tensor (or value) TorchDynamo recorded for an FX node, if any."""
    meta = node.meta
    return meta.get("example_value", meta.get("val"))


def size_expr(size):
    """A size from a fake tensor's shape: an int, or the sympy expression of a symbolic size (`s0`, `2*s1`)."""
    if isinstance(size, int):
        return size
    return size.node.expr  # torch.SymInt -> its sympy expression (checked: 2.5 - 2.13)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` with a graph of its own (node meta shallow-copied): lowering one copy through
    Inductor, which rewrites the graph it is given, leaves the other as TorchDynamo captured it.
    The copy keeps what marks a graph as TorchDynamo's for AOTAutograd (the module's meta, its
    `_param_name_to_source`, each input's `_dynamo_source`): from these it tells which inputs are
    weights, which Inductor's CUDA graphs (mode balanced's pinned shapes) then read in place instead
    of copying them at every replay; torch's `cudagraphs` backend ignores them (checked: torch 2.11 -
    2.13, `_try_get_metadata_from_dynamo`)."""
    graph = torch.fx.Graph()
    value, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value).meta = dict(output.meta)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for original, copied in zip(gm.graph.find_nodes(op="placeholder"), copy.graph.find_nodes(op="placeholder")):
        if hasattr(original, "_dynamo_source"):
            copied._dynamo_source = original._dynamo_source
    return copy


def is_weight(node: torch.fx.Node) -> bool:
    """A placeholder of a captured graph that holds a parameter or buffer: TorchDynamo lifts them to
    placeholders named after them (its naming rule, e.g. L__self___conv_parameters_weight_)."""
    return "_parameters_" in node.name or "_buffers_" in node.name


def size_hint(size) -> int:
    """A size as a number: an int as it is, a symbolic size by the value it had in the capture (its hint;
    checked: torch 2.5 - 2.13)."""
    if isinstance(size, int):
        return size
    return int(size.node.hint)


def outside_fake_mode():
    """A context where tensors are real even if the caller runs under a fake tensor mode (a compiler
    backend may): for measuring kernels on real inputs while compiling
    (`torch._subclasses.fake_tensor.unset_fake_temporarily`, checked: torch 2.5 - 2.13)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
