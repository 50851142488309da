"""How many CUDA graphs one compiled model may record: `shapes.max_cuda_graphs`.

With `cuda_graphs` on, torch's CUDA graph trees record one CUDA graph per shape signature of a
lowered graph (keyed by the values of its symbolic sizes), all sharing one memory pool per
device, inputs copied into static buffers, a recording never replayed for another shape. Left
alone they record every shape they ever see. The budget bounds that by the model's input shapes:
the first `max_cuda_graphs` of them to run record, each with every graph of the model (a model
compiled by blocks has one per region, at each of its sizes); a later shape runs the same compiled
kernels without CUDA graphs, and the log and `kiln.stats` say so. Correctness never depends on the
budget: it only decides whether torch records or replays. Counting graph by graph instead would
spend the whole budget on the first shape's regions (SD1.5 lowers 17 of them).

The input shape is the KilnModel call's (`for_call`, the shapes of its tensor arguments); a
lowered graph run outside such a call counts on its own, per signature. A specialised variant
evicted by `max_variants` and specialised again records again under its shape's place (torch keeps
the old recording until the model is released).

Mechanism: torch asks `int_key in inductor.config.triton.cudagraph_capture_sizes` before it
records or replays (checked: torch 2.11 - 2.13). While a Kiln call runs, that setting is this
budget (set and restored around the call, never left set), which answers for the signature
being run. Past 8 recordings of one graph torch warns (`triton.cudagraph_dynamic_shape_warn_limit`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Hashable, Optional

from ..torch_compat import cuda_graph_trees, module_calls

log = logging.getLogger("kiln")

RECORDED = "recorded"
OVER_BOUND = "none: max_cuda_graphs reached"
NOT_ASKED = "none: torch did not CUDA-graph this graph (TORCH_LOGS=perf_hints says why)"


class CudaGraphBudget:
    """One per compiled model. `run(record, fn, args)` runs one call of a lowered graph for the
    shape signature of `record` (a stats.VariantRecord; its `cuda_graph` field says what happened);
    inside `for_call(shape)` the place it takes is the model call's input shape."""

    def __init__(self, limit: int):
        self.limit = limit
        self.shapes: list = []        # the model input shapes admitted, in order
        self._outside: list = []      # VariantRecords admitted outside a model call, each a place
        self._refused_shapes: set = set()  # input shapes the log has said run without CUDA graphs
        self._refused_records: list = []   # graphs run outside a model call, likewise
        self._call_shape: Optional[Hashable] = None
        self._current = None
        self._asked = False
        self._scope = cuda_graph_trees.cuda_graph_capture_gate(self)
        self._said_uncopied = False   # the log said once that an output held no tensor to copy

    @property
    def recorded(self) -> int:
        """Places taken: model input shapes, and signatures of graphs run outside a model call."""
        return len(self.shapes) + len(self._outside)

    @contextlib.contextmanager
    def for_call(self, shape: Hashable):
        """One call of the model, whose tensor inputs have `shape` (any hashable summary of them), and
        one step of torch's CUDA graph trees (cuda_graph_trees.cuda_graph_step: by blocks, the regions' outputs
        stay valid through the call)."""
        self._call_shape = shape
        try:
            with cuda_graph_trees.cuda_graph_step():
                yield
        finally:
            self._call_shape = None

    def owned(self, outputs):
        """The call's outputs as the caller's own tensors (each copied; call it inside `for_call`).
        A step of torch's CUDA graph trees may reuse the memory of the last step's outputs: a tensor a
        replay returned (the whole model's output; by blocks, a region's output the model hands back as
        it is) is overwritten by the next call of the same shape, and torch refuses to read it then
        ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run", seen on
        an H100 with the whole SDXL UNet). A caller that keeps one call's output across the next (two
        calls for a guidance pair, a comparison with an earlier step) would fail. The copy costs one
        write of each output. Tensors in a container torch's pytree does not know cannot be found:
        when an output holds no tensor Kiln can find at all, the log says so, once."""
        copies = []

        def copy(tensor):
            copies.append(tensor)
            return tensor.clone()

        owned = module_calls.map_tensors(copy, outputs)
        if not copies and not self._said_uncopied:
            self._said_uncopied = True
            log.warning("Kiln: the model's output (a %s) holds no tensor Kiln can copy, so an output kept "
                        "across the next call may be overwritten by its CUDA graph replay", type(outputs).__name__)
        return owned

    def __contains__(self, int_key) -> bool:  # torch's question: may this shape record or replay?
        self._asked = True
        record = self._current
        if record is None:  # a CUDA-graphed function run outside Kiln's dispatch: not ours to bound
            return True
        shape = self._call_shape
        if shape in self.shapes if shape is not None else any(record is r for r in self._outside):
            return self._admit(record, shape)
        if self.recorded < self.limit:
            if shape is not None:
                self.shapes.append(shape)
                log.info("Kiln: CUDA graphs for input shape %d of %d: %s", len(self.shapes), self.limit, _shape_text(shape))
            else:
                log.info("Kiln: CUDA graph %d of %d for graph %d, %s", self.recorded + 1, self.limit,
                         record.graph, record.signature)
            return self._admit(record, shape)
        if record.cuda_graph != RECORDED:  # a recording made for an admitted shape keeps its label
            record.cuda_graph = OVER_BOUND
        said = shape in self._refused_shapes if shape is not None else any(record is r for r in self._refused_records)
        if not said:
            if shape is not None:
                self._refused_shapes.add(shape)
            else:
                self._refused_records.append(record)
            what = f"input shape {_shape_text(shape)}" if shape is not None else record.signature
            log.warning("Kiln: %s runs without CUDA graphs: this model already records %d "
                        "(shapes.max_cuda_graphs; raise it to record more)", what, self.limit)
        return False

    def _admit(self, record, shape) -> bool:
        if shape is None and not any(record is r for r in self._outside):
            self._outside.append(record)
        record.cuda_graph = RECORDED
        return True

    def run(self, record, fn, args):
        if self._scope is None:  # this torch has no capture-size gate: unbounded (warned by torch_compat.cuda_graph_trees)
            return fn(*args)
        self._current, self._asked = record, False
        try:
            with self._scope():
                out = fn(*args)
        finally:
            self._current = None
        if not self._asked and not record.cuda_graph:
            record.cuda_graph = NOT_ASKED
        return out


def _shape_text(shape) -> str:
    if isinstance(shape, tuple) and all(isinstance(dims, tuple) for dims in shape):
        return ", ".join("x".join(map(str, dims)) for dims in shape)
    return str(shape)


__all__ = ["CudaGraphBudget", "RECORDED", "OVER_BOUND", "NOT_ASKED"]
