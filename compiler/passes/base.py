"""What every Kiln rewrite pass shares: its context, its result, its identity, and FX helpers.

A pass works on the TorchDynamo FX graph (torch-level ops, parameters lifted to graph inputs,
fake tensors in `node.meta["example_value"]`), before Inductor lowers it. Invariants every pass
keeps are listed in `compiler/README.md`.
"""
from __future__ import annotations

import hashlib
import inspect
import operator
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.fx

from ..torch_compat.fx_graphs import fake_value

if TYPE_CHECKING:
    from .kernel_records import GpuClass


@dataclass
class PassContext:
    """What a pass may consult to decide whether a rewrite pays (never the weights' values)."""

    switch: str = "auto"            # "auto" | "on" | "off" for the pass being run
    device_type: str = "cpu"        # device of the graph's floating-point inputs
    triton: bool = False            # Triton kernels usable for this device
    grad_enabled: bool = False      # autograd on while compiling: custom kernels are inference-only
    inductor: bool = True           # Inductor lowers the graph afterwards (and fuses neighbours itself)
    mode: str = "balanced"          # for messages only; decisions ask `inductor`
    gpu: Optional["GpuClass"] = None  # the CUDA device's class (compiler/passes/kernel_records.py); None elsewhere


@dataclass
class PassResult:
    name: str
    rewrites: int = 0
    skipped: list[str] = field(default_factory=list)   # one reason per match left alone
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)     # what a rewrite chose, and why (a measured choice)

    def skip(self, reason: str) -> None:
        self.skipped.append(reason)

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)


class GraphPass:
    """One rewrite. Subclasses set `name` (= file name) and implement `apply(gm, ctx, result)`."""

    name: str = ""
    description: str = ""
    kernel_op: str = ""   # the kiln:: op it swaps in, if it is a kernel pass (inference-only, gated)

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        raise NotImplementedError

    def source_files(self) -> list[str]:
        """The files whose code decides what this pass does and what its output computes: the pass,
        the helpers every pass shares, and for a kernel pass the kernel (op, fake impl, reference) and its
        decision records (compiler/passes/kernel_records.py)."""
        files = [inspect.getsourcefile(type(self)), __file__]
        if self.kernel_op:
            kernels = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "kernels")
            op = self.kernel_op.split("::")[-1]
            files += [os.path.join(kernels, f"{op}.py"), os.path.join(kernels, "_library.py")]
            here = os.path.dirname(__file__)  # what decides where it fires on a GPU: the rule and its records
            files += [os.path.join(here, "kernel_records.py"), os.path.join(here, "kernel_records.json")]
        return [os.path.normpath(f) for f in files]

    def uuid(self) -> str:
        """Identity for caches (cf. Inductor's CustomGraphPass.uuid): a hash of `source_files()`, so it
        changes when the pass, the shared helpers or its kernel change. Kiln puts it into Inductor's
        FX graph cache key (`torch.compiler.config.cache_key_tag`, set while Kiln lowers)."""
        return hash_files(self.source_files())


def hash_files(paths: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


# ---- FX helpers shared by the passes -------------------------------------------------------

def is_call(node: torch.fx.Node, functions: Iterable = (), methods: Iterable[str] = ()) -> bool:
    """True if `node` calls one of `functions` or a tensor method named in `methods`."""
    if node.op == "call_function":
        return any(node.target is f for f in functions)
    if node.op == "call_method":
        return node.target in tuple(methods)
    return False


def arg(node: torch.fx.Node, index: int, name: str, default=None):
    """Argument `name` of a call, given positionally at `index` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def value(node) -> Optional[torch.Tensor]:
    """The fake tensor recorded for `node`, or None for non-nodes and non-tensors."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = fake_value(node)
    return val if isinstance(val, torch.Tensor) else None


def only_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def erase_unused(graph: torch.fx.Graph, *nodes: Optional[torch.fx.Node]) -> None:
    """Erase the given nodes (matched and replaced by a pass), in order, once nothing uses them."""
    alive = set(graph.nodes)
    for node in nodes:
        if node is not None and node in alive and not node.users:
            graph.erase_node(node)
            alive.discard(node)


def kernel_gate(ctx: PassContext, result: PassResult, what: str, without_inductor_only: bool = False) -> bool:
    """Shared decision for passes that swap in a Kiln kernel (a custom op).

    "auto" swaps only where the Triton kernel runs (CUDA + Triton): on a CPU the op would run its
    pure-torch reference, which is no faster than what Inductor generates for the same pattern.
    `without_inductor_only`: the kernel replaces a fusion Inductor makes itself, and better (Inductor
    also folds in the neighbours, e.g. the residual add before a norm, which a custom op blocks), so
    "auto" swaps it only where no Inductor runs (mode fast).
    Where Inductor lowers the graph on a GPU, "auto" also asks the pass's decision record for that GPU
    (compiler/passes/kernel_records.py): without an in-place measurement there showing the kernel
    beating Inductor's code, it is not swapped in.
    "on" swaps wherever the pattern matches. Custom kernels have no autograd formula, so with
    grad enabled nothing is swapped. Every refusal is recorded as a skip with its reason.
    """
    if ctx.grad_enabled:
        result.skip(f"{what}: autograd is enabled (Kiln kernels are inference-only; run under torch.no_grad())")
        return False
    if ctx.switch == "on":
        return True
    if ctx.device_type != "cuda":
        result.skip(f"{what}: {ctx.device_type} has no Triton kernel here; Inductor fuses this itself (force with passes: on)")
        return False
    if not ctx.triton:
        result.skip(f"{what}: Triton is not installed")
        return False
    if without_inductor_only and ctx.inductor:
        result.skip(f"{what}: in mode {ctx.mode} Inductor fuses this with its neighbours (the kernel serves mode fast; "
                    "force with passes: on)")
        return False
    if ctx.inductor and ctx.gpu is not None:  # against Inductor's code: the pass's record on this GPU decides
        from .kernel_records import shipped_decision

        decision = shipped_decision(result.name, ctx.gpu)
        if not decision.on:
            result.skip(f"{what}: {decision.why} (force with passes: on)")
            return False
    return True


MUL = (operator.mul, torch.mul)
ADD = (operator.add, torch.add)
DIV = (operator.truediv, torch.div, torch.true_divide)
