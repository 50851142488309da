"""How many CUDA graphs one compiled model may record: `shapes.max_cuda_graphs`.

With `cuda_graphs` on, torch's CUDA graph trees record one CUDA graph per shape signature of a
lowered graph (keyed by the values of its symbolic sizes), all sharing one memory pool per
device, inputs copied into static buffers, a recording never replayed for another shape. Left
alone they record every shape they ever see. The budget bounds that: the first
`max_cuda_graphs` signatures to run record (counted over every graph of the model); a later
signature runs the same compiled kernels without a CUDA graph, and the log and `kiln.stats` say
so. Correctness never depends on the budget: it only decides whether torch records or replays.
A specialised variant evicted by `max_variants` and specialised again is a new recording and
takes a new place (torch keeps the old one until the model is released).

Mechanism: torch asks `int_key in inductor.config.triton.cudagraph_capture_sizes` before it
records or replays (checked: torch 2.11 - 2.13). While a Kiln call runs, that setting is this
budget (set and restored around the call, never left set), which answers for the signature
being run. Past 8 recordings of one graph torch warns (`triton.cudagraph_dynamic_shape_warn_limit`).
"""
from __future__ import annotations

import logging

from . import compat

log = logging.getLogger("kiln")

RECORDED = "recorded"
OVER_BOUND = "none: max_cuda_graphs reached"
NOT_ASKED = "none: torch did not CUDA-graph this graph (TORCH_LOGS=perf_hints says why)"


class CudaGraphBudget:
    """One per compiled model. `run(record, fn, args)` runs one call of a lowered graph for the
    shape signature of `record` (a stats.VariantRecord; its `cuda_graph` field says what happened)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._recorded: list = []     # VariantRecords admitted to a CUDA graph, in order
        self._current = None
        self._asked = False
        self._scope = compat.cuda_graph_capture_gate(self)

    @property
    def recorded(self) -> int:
        return len(self._recorded)

    def __contains__(self, int_key) -> bool:  # torch's question: may this shape record or replay?
        self._asked = True
        record = self._current
        if record is None:  # a CUDA-graphed function run outside Kiln's dispatch: not ours to bound
            return True
        if any(record is r for r in self._recorded):
            return True
        if len(self._recorded) < self.limit:
            self._recorded.append(record)
            record.cuda_graph = RECORDED
            log.info("Kiln: CUDA graph %d of %d for graph %d, %s", len(self._recorded), self.limit,
                     record.graph, record.signature)
            return True
        if record.cuda_graph != OVER_BOUND:
            record.cuda_graph = OVER_BOUND
            log.warning("Kiln: graph %d runs %s without a CUDA graph: this model already has %d "
                        "(shapes.max_cuda_graphs; raise it to record more)", record.graph, record.signature, self.limit)
        return False

    def run(self, record, fn, args):
        if self._scope is None:  # this torch has no capture-size gate: unbounded (warned in compat)
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


__all__ = ["CudaGraphBudget", "RECORDED", "OVER_BOUND", "NOT_ASKED"]
