"""channels_last_convs: run 2-D convolution stacks in channels-last (NHWC) memory layout.

cuDNN's and oneDNN's fastest convolution kernels are NHWC; in NCHW they transpose around every
conv. The pass makes each conv2d's input and weight channels-last (`.contiguous(memory_format=
torch.channels_last)` is free when the tensor already is), so elementwise ops, GroupNorm and the
next conv stay NHWC, and converts graph outputs back to the layout eager returned. Weights are
converted inside the graph, never in the module: the module keeps owning its parameters and a
LoRA that installs a new NCHW parameter neither breaks nor recompiles the graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import GraphPass, PassContext, PassResult, value

CONV2D = (torch.conv2d, F.conv2d)
MIN_CONVS = 4  # a "stack": below this the conversions cost more than they save (a stem conv alone)


def pattern_channels_last_convs(x, w, b):
    return F.conv2d(F.silu(F.conv2d(x, w, b, padding=1)), w, b, padding=1)


def replacement_channels_last_convs(x, w, b):
    cl = torch.channels_last
    w = w.contiguous(memory_format=cl)
    h = F.silu(F.conv2d(x.contiguous(memory_format=cl), w, b, padding=1))
    return F.conv2d(h.contiguous(memory_format=cl), w, b, padding=1).contiguous()


def example_inputs():
    return (torch.randn(2, 6, 9, 11), torch.randn(6, 6, 3, 3), torch.randn(6))


def _is_channels_last(val: torch.Tensor) -> bool:
    return val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last) and not val.is_contiguous()


class ChannelsLastConvs(GraphPass):
    name = "channels_last_convs"
    description = "conv2d inputs and weights -> channels-last memory layout"

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        graph = gm.graph
        convs = [n for n in graph.nodes if n.op == "call_function" and n.target in CONV2D]
        if not convs:
            return
        if ctx.switch != "on":
            if len(convs) < MIN_CONVS:
                result.skip(f"{len(convs)} conv2d in the graph: fewer than {MIN_CONVS} do not pay for the layout change")
                return
            if ctx.device_type != "cuda":
                result.skip(f"{ctx.device_type}: channels-last convolutions measured no faster here (force with passes: on)")
                return
        converted = {}
        for conv in convs:
            for index in (0, 1):  # input, weight
                src = conv.args[index]
                val = value(src)
                if val is None or val.dim() != 4 or _is_channels_last(val):
                    continue
                if src not in converted:
                    with graph.inserting_before(conv):
                        cl = graph.call_method("contiguous", (src,), {"memory_format": torch.channels_last})
                    cl.meta["example_value"] = val  # same shape and dtype; layout differs
                    converted[src] = cl
                conv.update_arg(index, converted[src])
            result.rewrites += 1
        if result.rewrites:
            self._restore_output_layout(graph)

    @staticmethod
    def _restore_output_layout(graph: torch.fx.Graph) -> None:
        """4-D outputs that eager returned NCHW-contiguous are returned contiguous again."""
        output = next(n for n in reversed(graph.nodes) if n.op == "output")

        def restore(x):
            val = value(x)
            if val is None or val.dim() != 4 or not val.is_contiguous():
                return x
            with graph.inserting_before(output):
                out = graph.call_method("contiguous", (x,))
            out.meta["example_value"] = val
            return out

        output.args = torch.fx.node.map_arg(output.args, restore)
