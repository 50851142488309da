"""What every Kiln rewrite pass shares: its context, its result, its identity, and FX helpers.

A pass works on the TorchDynamo FX graph (torch-level ops, parameters lifted to graph inputs,
fake tensors in `node.meta["example_value"]`), before Inductor lowers it. Invariants every pass
keeps are listed in `compiler/README.md`.
"""
from __future__ import annotations

import hashlib
import inspect
import operator
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.fx

from ..compat import fake_value


@dataclass
class PassContext:
    """What a pass may consult to decide whether a rewrite pays (never the weights' values)."""

    switch: str = "auto"            # "auto" | "on" | "off" for the pass being run
    device_type: str = "cpu"        # device of the graph's floating-point inputs
    triton: bool = False            # Triton kernels usable for this device
    grad_enabled: bool = False      # autograd on while compiling: custom kernels are inference-only
    mode: str = "balanced"


@dataclass
class PassResult:
    name: str
    rewrites: int = 0
    skipped: list[str] = field(default_factory=list)   # one reason per match left alone
    seconds: float = 0.0

    def skip(self, reason: str) -> None:
        self.skipped.append(reason)


class GraphPass:
    """One rewrite. Subclasses set `name` (= file name) and implement `apply(gm, ctx, result)`."""

    name: str = ""
    description: str = ""
    kernel_op: str = ""   # the kiln:: op it swaps in, if it is a kernel pass (inference-only, gated)

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        raise NotImplementedError

    def uuid(self) -> str:
        """Stable identity for caches: a hash of the pass's source file (cf. Inductor's CustomGraphPass)."""
        source = inspect.getsourcefile(type(self))
        with open(source, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]


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


def kernel_gate(ctx: PassContext, result: PassResult, what: str, fast_mode_only: bool = False) -> bool:
    """Shared decision for passes that swap in a Kiln kernel (a custom op).

    "auto" swaps only where the Triton kernel runs (CUDA + Triton): on a CPU the op would run its
    pure-torch reference, which is no faster than what Inductor generates for the same pattern.
    `fast_mode_only`: the kernel replaces a fusion Inductor makes itself, and better (Inductor also
    folds in the neighbours, e.g. the residual add before a norm, which a custom op blocks), so
    "auto" swaps it only in mode fast, where no Inductor runs.
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
    if fast_mode_only and ctx.mode != "fast":
        result.skip(f"{what}: in mode {ctx.mode} Inductor fuses this with its neighbours (the kernel serves mode fast; "
                    "force with passes: on)")
        return False
    return True


MUL = (operator.mul, torch.mul)
ADD = (operator.add, torch.add)
DIV = (operator.truediv, torch.div, torch.true_divide)
