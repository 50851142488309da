"""Every pass's `pattern_<x>` / `replacement_<x>` examples hold the real pass to account.

Each pass file documents what it rewrites with two example functions and `example_inputs()`.
The other tests check that the two examples compute the same thing; these check that the pass
itself (its hand-written matcher, `GraphPass.apply`) still does what the examples say:

1. the pass's module has `pattern_<x>`, `replacement_<x>` and `example_inputs`;
2. run on the FX graph TorchDynamo captures from `pattern_<x>` (captured as Kiln's backend sees
   graphs: `fullgraph=True`, no autograd, both with static shapes and with the batch and
   resolution made dynamic as `kiln.compile` does by default), the pass rewrites it at least
   once and records no skip;
3. the rewritten graph (lowered as mode fast lowers it: the FX graph itself, no Inductor)
   computes what `replacement_<x>` computes, and now contains the ops the replacement's own
   captured graph has that the pattern's has not (the `kiln::` kernel op, SDPA, the
   channels-last conversions) and none of the ops the pattern has that the replacement has not
   (softmax, gelu, group_norm / silu, layer_norm, ...).

The pass is forced on ("on") so the CPU gate lets the kernels in; on a CPU the kernel ops run
their torch references. A pass added to `PASSES` without examples fails here.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import pytest
import torch

from kiln.compiler.passes import PASSES, GraphPass, PassContext, PassResult
from kiln.compiler.shapes.inputs import mark_batch_and_resolution_dynamic
from testing_utils import rel_err

SHAPES = ("static", "kiln_auto")  # kiln_auto: batch and resolution dynamic, as kiln.compile's default


@dataclasses.dataclass
class Example:
    name: str
    pattern: Callable
    replacement: Callable
    inputs: Callable


def examples_of(graph_pass: GraphPass) -> list[Example]:
    """The `pattern_<x>` / `replacement_<x>` pairs and `example_inputs` of the pass's own module."""
    module = inspect.getmodule(type(graph_pass))
    names = [n for n, f in vars(module).items() if n.startswith("pattern_") and inspect.isfunction(f)]
    inputs = getattr(module, "example_inputs", None)
    pairs = []
    for name in names:
        suffix = name[len("pattern_"):]
        replacement = getattr(module, f"replacement_{suffix}", None)
        assert callable(replacement), f"{module.__name__} has {name} but no replacement_{suffix}"
        pairs.append(Example(suffix, getattr(module, name), replacement, inputs))
    replacements = {n for n in vars(module) if n.startswith("replacement_")}
    assert replacements == {f"replacement_{e.name}" for e in pairs}, \
        f"{module.__name__}: replacement_* without a pattern_*: {sorted(replacements)}"
    return pairs


def op_key(node: torch.fx.Node) -> str | None:
    """What a node computes, independent of spelling: `a * b`, `torch.mul` and `Tensor.mul` are all
    "mul"; a custom op is its qualified name without overload ("kiln::geglu"); a memory-format
    argument is part of the key (it is what a layout rewrite changes)."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            name = target._schema.name if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
        else:
            name = getattr(target, "__name__", str(target))
    elif node.op == "call_method":
        name = node.target
    else:
        return None  # placeholders, outputs, attributes: not ops
    fmt = node.kwargs.get("memory_format")
    return f"{name}[memory_format={fmt}]" if fmt is not None else name


def op_keys(graph: torch.fx.Graph) -> set[str]:
    return {k for k in map(op_key, graph.nodes) if k is not None}


@dataclasses.dataclass
class Capture:
    ops_before: set = dataclasses.field(default_factory=set)
    ops_after: set = dataclasses.field(default_factory=set)
    results: list = dataclasses.field(default_factory=list)
    graphs: int = 0
    dynamic: bool = False   # some input size is symbolic in the captured graph


def run_captured(fn: Callable, inputs: tuple, shapes: str, graph_pass: GraphPass | None = None):
    """Call `fn(*inputs)` through TorchDynamo with a backend that records the captured graph's ops,
    runs `graph_pass` on it (if any) as `run_passes` does, forced on, and lowers it as mode fast
    does (the FX graph's own forward). Returns (output, Capture)."""
    capture = Capture()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        capture.graphs += 1
        capture.dynamic |= any(isinstance(n.meta.get("example_value"), torch.SymInt)
                               for n in gm.graph.nodes if n.op == "placeholder")
        capture.ops_before |= op_keys(gm.graph)
        if graph_pass is not None:
            device = next((x.device.type for x in example_inputs
                           if isinstance(x, torch.Tensor) and x.is_floating_point()), "cpu")
            ctx = dict(switch="on", device_type=device, triton=False, grad_enabled=torch.is_grad_enabled(), mode="fast")
            if "inductor" in {f.name for f in dataclasses.fields(PassContext)}:
                ctx["inductor"] = False  # lowered as mode fast lowers: no Inductor after the pass
            ctx = PassContext(**ctx)
            result = PassResult(graph_pass.name)
            graph_pass.apply(gm, ctx, result)
            capture.results.append(result)
            gm.graph.lint()
            gm.recompile()
        capture.ops_after |= op_keys(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    if shapes == "kiln_auto":
        mark_batch_and_resolution_dynamic(inputs, {})
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False if shapes == "static" else None)
    out = compiled(*inputs)
    torch._dynamo.reset()
    return out, capture


def _layout_only(ops: set) -> bool:
    return bool(ops) and all(k == "contiguous" or "memory_format=" in k for k in ops)


@pytest.mark.parametrize("graph_pass", PASSES, ids=lambda p: p.name)
def test_pass_has_examples(graph_pass):
    module = inspect.getmodule(type(graph_pass))
    examples = examples_of(graph_pass)
    assert examples, f"{module.__name__} has no pattern_<x> / replacement_<x> examples"
    assert callable(getattr(module, "example_inputs", None)), f"{module.__name__} has no example_inputs()"


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("graph_pass", PASSES, ids=lambda p: p.name)
def test_pass_rewrites_its_own_example(graph_pass, shapes):
    examples = examples_of(graph_pass)
    assert examples and callable(examples[0].inputs), f"{graph_pass.name}: no examples (see test_pass_has_examples)"
    for example in examples:
        torch.manual_seed(0)
        inputs = example.inputs()
        what = f"{graph_pass.name}: pattern_{example.name} ({shapes} shapes)"

        # the replacement's own graph: which ops it uses that the pattern does not, and vice versa
        ref, replaced = run_captured(example.replacement, tuple(x.clone() for x in inputs), shapes)
        out, captured = run_captured(example.pattern, tuple(x.clone() for x in inputs), shapes, graph_pass)
        assert replaced.graphs == 1 and captured.graphs == 1
        assert captured.dynamic == (shapes == "kiln_auto"), f"{what}: captured dynamic={captured.dynamic}"
        added = replaced.ops_before - captured.ops_before
        removed = captured.ops_before - replaced.ops_before
        assert added, f"{what}: replacement_{example.name} uses no op the pattern lacks; nothing to check"
        assert removed or _layout_only(added), \
            f"{what}: the replacement removes no op of the pattern and is not a layout change ({sorted(added)})"
        if type(graph_pass).kernel_op:
            assert type(graph_pass).kernel_op in added, \
                f"{what}: replacement_{example.name} does not call the pass's kernel {type(graph_pass).kernel_op}"

        # 2. the real pass rewrote the example, without a skip
        (result,) = captured.results
        assert result.rewrites >= 1, f"{what}: the pass did not rewrite its own example"
        assert not result.skipped, f"{what}: the pass skipped its own example: {result.skipped}"

        # 3. the rewritten graph computes the replacement, with the replacement's ops in it
        assert rel_err(out, ref) < 1e-5, f"{what}: rewritten graph differs from replacement_{example.name}"
        if isinstance(ref, torch.Tensor):
            # and returns it in the replacement's layout (channels_last_convs restores eager's NCHW)
            assert (out.shape, out.dtype, out.stride()) == (ref.shape, ref.dtype, ref.stride()), what
        missing = added - captured.ops_after
        assert not missing, f"{what}: rewritten graph lacks {sorted(missing)} (ops: {sorted(captured.ops_after)})"
        left = removed & captured.ops_after
        assert not left, f"{what}: rewritten graph still has {sorted(left)} (ops: {sorted(captured.ops_after)})"
