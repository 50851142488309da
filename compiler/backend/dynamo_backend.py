"""Kiln's TorchDynamo backend: rewrite the captured FX graph with Kiln's passes, then lower it.

TorchDynamo calls `KilnBackend(gm, example_inputs)` once per captured graph (per shape
specialisation or graph break). Parameters arrive as graph inputs, so the compiled code reads
the module's live weights on every call: nothing is frozen into constants.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from .. import cpu
from ..torch_compat import dynamo, fx_graphs
from ..cache import entry_fields, graph_hash
from .context import CompileUnit, ModelContext
from . import lowering as lowerings
from .lowering import LoweringFailed
from ..options.compile_options import CompileOptions
from ..passes import PASSES, PassContext, Progress, passes_uuid, run_passes
from ..passes.kernel_records import gpu_class_among
from ..shapes.shape_manager import ShapeDispatcher
from ..stats import GraphCompile

log = logging.getLogger("kiln")


def device_type_of(values) -> str:
    """The device type of the first floating-point tensor among `values` ("cpu" when none)."""
    for x in values:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.device.type
    return "cpu"


def _is_dynamic(gm: torch.fx.GraphModule) -> bool:
    return any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")


def _user_input_shapes(gm: torch.fx.GraphModule) -> list[list]:
    """Shapes of graph inputs that are not parameters or buffers (the activations)."""
    shapes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or fx_graphs.is_weight(node):
            continue
        val = node.meta.get("example_value")
        if isinstance(val, torch.Tensor):
            shapes.append([int(s) if isinstance(s, int) else str(s) for s in val.shape])
    return shapes


# options that never change how a captured graph is lowered: left out of its cache key
NOT_LOWERING = ("shapes", "compile_unit", "measure_regions", "background", "glue_regions")


def lowering_options(options: CompileOptions) -> dict:
    """The options that decide a graph's lowering, as plain data (a cache key's "options" field)."""
    return {name: value for name, value in options.as_dict().items() if name not in NOT_LOWERING}


# torch's `cudagraphs` backend keeps in place only the parameters it lifts from a graph's module
# (static_input_idxs), and a graph TorchDynamo captures with `inline_inbuilt_nn_modules` takes the
# weights as inputs: CUDA graph trees copy every other input into the recording's buffers at each replay
FAST_CUDA_GRAPHS_COPY_WEIGHTS = (
    "mode fast records CUDA graphs with torch's cudagraphs backend, which copies the weights a graph "
    "takes into the recording's buffers at every replay (the model's weights once a call). Mode "
    "balanced's CUDA graphs read the weights in place.")


class KilnBackend:
    """A TorchDynamo backend bound to one compiled unit of a model (compiler/backend/context.py): the
    whole model, or one block region. It knows the unit only through its `CompileUnit`.

    The unit's `code` is the code object TorchDynamo compiles, named when TorchDynamo's recompile
    limit for it is reached. The reason for a recompile is the guard
    failure TorchDynamo recorded during that call; the graph breaks it hit while capturing a graph
    (code it cannot trace, e.g. a patch calling `.item()`) are kept with that graph and logged once
    per place, since the model then runs as several graphs with Python between them.

    `progress(what, done, total)` is the caller's: if it raises (ComfyUI's cancel button raises
    from its progress callback), the compile stops there and `interrupt` holds what it raised, so
    the caller can tell a cancelled compile from a failed one (TorchDynamo wraps both alike).
    """

    def __init__(self, context: ModelContext, unit: CompileUnit = CompileUnit(), progress: Optional[Progress] = None):
        self.context = context
        self.unit = unit
        self.options = context.options
        self.stats = context.stats
        self.code = unit.code
        self.progress = progress
        # guard failures TorchDynamo had recorded (per code object) before this call's capture; taken
        # at the start of each call and dropped at its end (it holds code objects: never keep it)
        self._failures_seen: dict = {}
        self._warned_cuda_graphs = False
        self.graphs = 0           # graphs this backend compiled
        self.calls = 0            # calls of the compiled module finished so far
        self.interrupt: Optional[BaseException] = None  # what the progress callback raised, if it did
        self._capture_from = None  # the call's start, or the end of its previous graph: TorchDynamo captures from then
        self._breaks_seen = 0      # TorchDynamo's graph-break count at the same moment
        self._breaks_logged: set[str] = set()

    def _reason(self) -> str:
        new, self._failures_seen = dynamo.guard_failures_since(self._failures_seen), dynamo.guard_failure_counts()
        if not self.graphs:
            return "first compile"
        # failures of cache entries compiled by other backends (other kiln.compile / torch.compile
        # of the same forward) say BACKEND_MATCH: they are not this model's reason
        own = [f for f in new if "BACKEND_MATCH" not in f] or new
        # one failure per graph TorchDynamo checked, the newest graph's first: the graph that nearly
        # served this call says what changed (the oldest may have failed long ago for another reason)
        return f"recompile: {own[0]}" if own else "another graph of the same call (graph break)"

    def _graph_breaks(self) -> list[str]:
        """The graph breaks TorchDynamo hit while capturing this graph (it ends at the last one); each
        place is logged once per model: what runs there runs in Python, between compiled graphs."""
        breaks = list(dict.fromkeys(dynamo.graph_breaks_since(self._breaks_seen)))  # a restarted capture repeats one
        for where in breaks:
            if where not in self._breaks_logged:
                self._breaks_logged.add(where)
                log.warning("Kiln: %s: TorchDynamo breaks the graph at %s; the model runs as several compiled graphs "
                            "with that code run by Python between them (slower than one graph; each piece is "
                            "guarded and recompiled on its own)", self._label(), where)
        return breaks

    def report(self, what: str, done: int, total: int) -> None:
        """Tell the caller's progress callback; remember it if the callback raises (a cancel)."""
        if self.progress is None:
            return
        try:
            self.progress(what, done, total)
        except BaseException as exc:
            self.interrupt = exc
            raise

    # ---- around each call of the compiled model: catch calls TorchDynamo ran eagerly ----------

    def run(self, call, eager, fall_back):
        """`call()` (the compiled entry on this call's inputs) with everything around it: a failed
        compile calls `fall_back(reason, exc)` and answers with `eager()`; a cancel from the progress
        callback is re-raised untouched (nothing was installed); TorchDynamo's record for the entry's
        code is dropped after every call."""
        self.before_call()
        try:
            out = call()
        except Exception as exc:
            if self.interrupt is not None:  # cancelled, not failed
                raise self.interrupt from None
            if not (isinstance(exc, (*dynamo.compile_failure_types(), LoweringFailed)) or dynamo.failed_while_capturing(exc)):
                raise  # the model's own error, compiled or not
            fall_back(f"compile failed: {dynamo.describe_compile_failure(exc)}", exc)
            return eager()
        else:
            self.after_call()
            return out
        finally:
            self.end_call()
            dynamo.forget_code(self.code)

    def before_call(self):
        self.interrupt = None
        self._capture_from = time.perf_counter()
        self._breaks_seen = dynamo.graph_break_count()
        self._failures_seen = dynamo.guard_failure_counts()
        self._call_compiles = self.graphs

    def end_call(self) -> None:
        """After every call, however it ended."""
        self._failures_seen = {}

    def after_call(self):
        self.calls += 1
        if self.graphs > self._call_compiles:
            return
        # no compile in this call, so _failures_seen is still the snapshot before_call took
        guard_failed = dynamo.guard_failure_counts() != self._failures_seen
        if self.graphs == 0 or guard_failed:
            # No graph serves this call and none was compiled: TorchDynamo ran it eagerly, which
            # happens when its recompile limit for this forward is used up. Say so; never hide it.
            unit = self.unit.describe()
            reason = (f"TorchDynamo ran a call eagerly: no compiled graph fits it and none was compiled "
                      f"(its recompile limit, {dynamo.recompile_limit()} graphs per {unit}, reached for "
                      f"{getattr(self.code, 'co_name', 'this ' + unit)}? dynamic auto serves new shapes from one graph)")
            self.stats.eager_calls += 1
            if self.stats.eager_calls == 1:
                log.warning("Kiln: %s", reason)
                self.stats.eager_call_reason = reason
                self.stats.warnings.append(reason)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        capture = start - (self._capture_from or start)
        reason = self._reason()
        breaks = self._graph_breaks()
        device = device_type_of(example_inputs)
        if self.options.cuda_graphs and device != "cuda" and not self._warned_cuda_graphs:
            self._warned_cuda_graphs = True
            log.warning("Kiln: cuda_graphs is on but the model runs on %s; CUDA graphs are not used", device)
        from ...kernels import triton_available

        lowering = self.options.lowering
        if self.options.cuda_graphs and device == "cuda" and not lowering.uses_inductor \
                and self.stats.warn_once(FAST_CUDA_GRAPHS_COPY_WEIGHTS):
            log.warning("Kiln: %s", FAST_CUDA_GRAPHS_COPY_WEIGHTS)
        index = len(self.stats.compiles)
        as_captured = self.unit.as_captured(gm, device, not self.graphs and not breaks) if self.unit.as_captured else ""
        if as_captured:
            return self._run_as_captured(gm, as_captured, reason, breaks, capture, start, index)
        graph = graph_hash(gm, fx_graphs.is_weight) if self._caching() else ""  # the captured structure, before the passes
        ctx = PassContext(device_type=device, triton=triton_available() and device == "cuda",
                          grad_enabled=torch.is_grad_enabled(), inductor=lowering.uses_inductor, mode=self.options.mode,
                          gpu=gpu_class_among(example_inputs) if device == "cuda" else None)
        total = len(PASSES) + 1
        results = run_passes(gm, ctx, dict(self.options.passes), self.report, total)
        dynamic = _is_dynamic(gm)
        # the shape manager may lower the rewritten graph again for a static signature: keep it as
        # it is now (Inductor rewrites the graph it lowers)
        specialisable = dynamic and lowering.can_specialise and self.options.shapes.specialize != "none"
        captured = fx_graphs.copy_graph_module(gm) if specialisable else gm
        cache_tag = f"kiln-{passes_uuid()}"

        def lower(graph_module, args, label):
            cpu.before_lowering(device)  # before Kiln's cache points Inductor at a private folder
            if not self._caching():
                return lowerings.lower_graph(lowering, graph_module, args, self.options, device, cache_tag)
            options = lowering_options(self.options)
            fields = entry_fields(graph, args, options, self.options.shapes.as_dict(), device,
                                  f"{self._label()} {label}")
            compiled, name, event = self.context.cache.lower(
                lambda: lowerings.lower_graph(lowering, graph_module, args, self.options, device, cache_tag), fields)
            self.stats.cache.append(event)
            return compiled, name + (" (from Kiln's cache)" if event.outcome == "hit" else "")

        lowered, lowering_name = lower(gm, example_inputs, f"graph {index}")
        self.report(f"lowered by {lowering_name}", total, total)
        record = GraphCompile(
            index=index, reason=reason, lowering=lowering_name,
            input_shapes=_user_input_shapes(gm), nodes=len(gm.graph.nodes),
            rewrites={r.name: r.rewrites for r in results}, skipped={r.name: r.skipped for r in results if r.skipped},
            seconds=time.perf_counter() - start, dynamic=dynamic, capture_seconds=capture, graph_breaks=breaks,
            region=self.unit.name, notes={r.name: r.notes for r in results if r.notes},
        )
        self._recorded(record)
        log.info("Kiln compiled %s", record.line())
        budget = self.context.budget_for(device)
        if budget is None and (not dynamic or (not self.unit.is_whole_model and not specialisable)):
            # a unit that is not the whole model (a block region) serves every size its guards admit
            # from this graph: the shape manager routes them only where the shape policy specialises some
            return lowered
        # a dynamic graph serves many shape signatures: the shape manager records and routes them
        # (a static one only its own; it goes through the shape manager to count its CUDA graph)

        def lower_static(graph_module, args):
            placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
            shapes = ", ".join("x".join(map(str, a.shape)) for n, a in zip(placeholders, args)
                               if isinstance(a, torch.Tensor) and not fx_graphs.is_weight(n))
            return lower(graph_module, args, f"graph {index} static {shapes}")[0]

        return ShapeDispatcher(captured, lowered, lower_static if specialisable else None, self.options.shapes,
                               self.stats, record.index, record.capture_seconds + record.seconds, self.report,
                               compile_pinned=dynamic and self.calls == 0 and self.unit.is_whole_model,
                               cuda_graphs=budget, call_shape=self.unit.call_shape)

    def _run_as_captured(self, gm, why: str, reason: str, breaks: list[str], capture: float, start: float,
                         index: int):
        """Run the captured graph as it is (TorchDynamo's FX graph: the unit's own ops), as the unit's
        rule said (`CompileUnit.as_captured`), recorded and said like a lowering."""
        record = GraphCompile(
            index=index, reason=f"{reason}; kept eager, {why}", lowering="eager", input_shapes=_user_input_shapes(gm),
            nodes=len(gm.graph.nodes), rewrites={}, skipped={}, seconds=time.perf_counter() - start,
            dynamic=_is_dynamic(gm), capture_seconds=capture, graph_breaks=breaks, region=self.unit.name)
        self._recorded(record)
        total = len(PASSES) + 1
        self.report(f"kept eager: {why}", total, total)
        log.info("%s", record.line())
        return gm.forward

    def _recorded(self, record: GraphCompile) -> None:
        """Keep a graph's record; TorchDynamo captures the call's next graph from now."""
        self.stats.compiles.append(record)
        self.graphs += 1  # counted once recorded: TorchDynamo may call a backend again for one graph (a restarted capture)
        self._capture_from = time.perf_counter()
        self._breaks_seen = dynamo.graph_break_count()

    def _caching(self) -> bool:
        return self.context.cache is not None and self.options.lowering.uses_inductor

    def _label(self) -> str:
        """The model's label, with the unit's name: what cache listings and logs show."""
        return f"{self.context.label} {self.unit.name}" if self.unit.name else self.context.label
