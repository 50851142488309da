"""A model compiled by blocks: one compiled entry per region, and the guard around every block call.

`RegionalCompile` holds, for one KilnModel, a `CompiledRegion` per distinct block (compiler/regional/blocks.py).
Each has an entry function with a code object of its own (TorchDynamo keeps graphs and counts its
recompile limit per code object, so every region of every model has its own budget) and a
KilnBackend of its own, sharing the model's ModelContext (options, stats, cache, CUDA-graph budget).
While the model runs (`routed()`), a call of any block goes to its region's compiled entry with the
block itself as an argument: its parameters are graph inputs, so the blocks of one region share the
graphs and each reads its own live weights (LoRA and in-place patches show up without a recompile).
What tells identical blocks apart is hidden where nothing reads it (compiler/regional/block_positions.py).

**A region's states** (`RegionState`), in the order a region moves through them:

- NEW: not called yet; its first call decides and compiles it, in the foreground.
- WAITING, HELD_BACK, HANDED (`background: true`, compiler/regional/background.py): its blocks run
  eagerly; its first call asks the deciders that need no other region's verdict, then hands a copy of
  its inputs to the model's lowering thread (HELD_BACK while those would pass MAX_HELD_BYTES: asked
  again at a later call), which asks the rest and compiles it.
- MEASURE_DUE: compiled in the background; its next call while the thread is idle measures it.
- COMPILED: its blocks run its code from now on (it may still compile more graphs: shapes, dtypes).
- EAGER (by choice) and FAILED (its compile failed): its blocks run eagerly from now on, never undone.

**Decided eager before any capture**: the deciders in DECIDERS, asked in that order from one place
(`_eager_before_capture`): a choice stored in Kiln's cache (a timing, or the verdict that its block
has nothing to fuse), the verdict of its block class, and the CPU's rule (compiler/cpu). In the
background the class verdict is asked on the thread (it waits for the class's first regions), the
others at the hand-in. A region that already holds a timing (stored) asks no more.

**Decided by its first graph**: a block whose whole code is one graph with nothing for Inductor to fuse
(compiler/regional/fusible.py) runs as captured, and its region eager. **Decided by measurement**: a
region with something to fuse is timed right after its first graph compiled, compiled and eagerly on
copies of the same inputs, and stays compiled only where that is faster (compiler/regional/region_choice.py).
Each choice is kept in Kiln's cache, so a later start never captures a region measured slower.

Per region, as the whole model has it: the first call compiles (with the region named in the
progress, the log and the stats); a failed compile sends that region, and only it, to eager with the
reason logged and kept (`stats.region_fallbacks`); a cancel from the progress callback propagates
untouched and keeps nothing of the half-done compile.
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import time
from typing import NamedTuple, Optional

import torch

from .. import cpu
from ..backend.context import CompileUnit, ModelContext
from ..backend.dynamo_backend import KilnBackend, device_type_of, lowering_options
from ..cache import choice_fields
from ..graphs.fidelity_guard import region_check
from ..host_layers import stand_ins
from ..options.compile_options import CompileOptions
from ..passes import Progress
from ..shapes.inputs import contiguous_inputs, model_latent, tensors_in
from ..shapes.shape_manager import CallShape
from ..torch_compat import dynamo, module_calls
from . import fusible, gpu_choice, region_choice
from .background import CallerState, HeldInputs, LoweringThread
from .block_positions import calls_position_patches, carries_position, positions_hidden
from .blocks import Region

log = logging.getLogger("kiln")

# the model call the regions' blocks run in, where the shape policy specialises (RegionalCompile.routed);
# a context variable, so that the lowering thread can set the call of the inputs it lowers on
_call_shape: contextvars.ContextVar[Optional[CallShape]] = contextvars.ContextVar("kiln_call_shape", default=None)


def current_call_shape() -> Optional[CallShape]:
    return _call_shape.get()


# the sets of streamed blocks whose routes are kept (a host's partial loads differ by what else is loaded; a
# few states recur): past it, the kept ones are dropped and made again
MAX_EAGER_SETS = 8


class RegionState(enum.Enum):
    """Where a region stands (see the module docstring)."""

    NEW = "not called yet"
    WAITING = "waiting for its first call to hand it to the lowering thread"
    HELD_BACK = "waiting: its inputs would pass MAX_HELD_BYTES; handed in at a later call"
    HANDED = "queued on the lowering thread"
    MEASURE_DUE = "compiled in the background; measured by its next call while the thread is idle"
    COMPILED = "compiled"
    EAGER = "runs eagerly by choice"
    FAILED = "runs eagerly: its compile failed"


BEFORE_LOWERED = (RegionState.WAITING, RegionState.HELD_BACK, RegionState.HANDED)  # blocks run eagerly meanwhile
RUNS_EAGERLY = (RegionState.EAGER, RegionState.FAILED)  # never undone


class Decider(NamedTuple):
    """A rule that may decide a region eager before its first capture (DECIDERS)."""

    waits_for_class: bool    # needs the verdict of the region's block class: asked on the lowering thread
    ask: str                 # the CompiledRegion method that answers, given (block, args, kwargs): True for eager


def may_stay_eager(options: CompileOptions, device: str) -> bool:
    """Whether a region may run eagerly by choice on `device`: not where lowering would make its library
    ops faster, with autotuning (it may pick a generated convolution), nor with CUDA graphs (which pay
    on any graph: fewer launches). In mode fast the graph would run as captured anyway, behind
    TorchDynamo's entry."""
    return (options.lowering.inductor_preset is None
            and not any(name.startswith("max_autotune") and value for name, value in options.inductor.items())
            and not (options.cuda_graphs and device == "cuda"))


class CompiledRegion:
    """One region's compiled entry and the guard every call of one of its blocks goes through."""

    def __init__(self, region: Region, context: ModelContext, progress: "RegionProgress",
                 verdicts: region_choice.ClassVerdicts, background: Optional["Background"] = None):
        self.region = region
        self.verdicts = verdicts  # what this model's regions measured, per block class
        self.stats = context.stats
        self.label = context.label
        self.options = context.options
        self.cache = context.cache
        self.state = RegionState.WAITING if background is not None else RegionState.NEW
        self.why_eager = ""  # with state EAGER or FAILED: why
        self.idle: Optional[fusible.IdleRecord] = None  # its first graph had nothing to fuse: to keep in the cache
        self.fidelity = None  # a FidelityGuard (compiler/graphs/fidelity_guard.py) where the model checks its regions
        entry = dynamo.own_code(module_calls.call_module_body,
                                f"kiln_{self.label}_{region.name}".replace(".", "_").replace("#", "_"))
        self.backend = KilnBackend(context, CompileUnit(code=entry.__code__, name=region.name,
                                                        call_shape=current_call_shape, as_captured=self._as_captured))
        self.background = background
        # the lowering thread never calls the model's progress callback (it clears ComfyUI's cancel)
        self.backend.progress = progress.for_region(region) if background is None else None
        # auto: every size of a tensor the block is given (in a tuple, list or dict too) is marked
        # dynamic before each call (a block's inputs are sized by the batch and the resolution in ways
        # it cannot tell apart from its channels; TorchDynamo keeps the sizes its weights fix static
        # anyway).
        # Everything else follows TorchDynamo's automatic dynamism, as in a whole-model compile: a
        # Python number the block reads (a norm's eps, the weight of an IPAdapter patch) is a constant
        # in the first graph, for Kiln's passes, and becomes an input of a second graph the first
        # time it changes, never a third
        self.mark_sizes = self.options.dynamic is None
        self.compiled = torch.compile(entry, backend=self.backend, dynamic=self.options.dynamic,
                                      fullgraph=self.options.fullgraph)

    @property
    def runs_eagerly(self) -> bool:
        """Its blocks run eagerly from now on: by choice, or after its compile failed (never undone)."""
        return self.state in RUNS_EAGERLY

    @property
    def timed(self) -> bool:
        """The region holds a timing, measured or stored: it is not measured again, nor judged by its class."""
        return self.region.name in self.stats.region_timings

    def __call__(self, block: torch.nn.Module, *args, **kwargs):
        state = self.state
        if state in RUNS_EAGERLY:
            return module_calls.call_module_body(block, *args, **kwargs)
        args, kwargs = contiguous_inputs(args, kwargs)
        if state in BEFORE_LOWERED:
            return self._eagerly_until_lowered(block, args, kwargs)
        if state is RegionState.NEW:
            return self._first_call(block, args, kwargs)
        out = self._run_compiled(block, args, kwargs)
        if state is RegionState.MEASURE_DUE and self.state is state and not self.background.thread.busy():
            self._measure(block, args, kwargs)  # timed beside a lowering, it would mislead
            self.background.thread.wake()  # the regions of its class that waited for the verdict
        return out

    def _first_call(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        """In the foreground: the deciders, else the region's first compiled call and its measurement."""
        if self._eager_before_capture(block, args, kwargs, DECIDERS):
            return module_calls.call_module_body(block, *args, **kwargs)
        out = self._run_compiled(block, args, kwargs)
        if self.state is RegionState.NEW:
            self._measure(block, args, kwargs)
        elif self.idle is not None:
            self._store_idle(args, kwargs)
        if self.background is not None:
            self.background.thread.wake()  # the regions of its class that waited for the verdict
        return out

    # ---- decided eager before any capture: DECIDERS, asked from here only ----------------------------

    def _eager_before_capture(self, block: torch.nn.Module, args: tuple, kwargs: dict, deciders) -> bool:
        """Ask `deciders` in order, until one decides the region eager (then True) or the region holds a
        timing; a region decided eager here is never captured."""
        for decider in deciders:
            if self.timed:
                return False
            if getattr(self, decider.ask)(block, args, kwargs):
                self._say_if_nothing_compiled()
                return True
        return False

    def _stored_choice(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """Kiln's cache holds, for these inputs here, the verdict that the block has nothing to fuse, or
        a choice measured before (kept as the region's timing; True when it says eager)."""
        device = device_type_of((*args, *kwargs.values())) if self.cache is not None else None
        if device is None or not may_stay_eager(self.options, device):
            return False
        records = self.cache.read_records(self._choice_fields(args, kwargs, device))
        if fusible.IDLE_FILE in records and gpu_choice.runs_as_captured_when_idle(device):
            try:
                idle = fusible.IdleRecord.from_bytes(records[fusible.IDLE_FILE],
                                                     f"the stored verdict of region {self.region.name}")
            except ValueError as exc:
                log.warning("Kiln: %s: ignored %s; the region is captured again", self.label, exc)
            else:
                return self._decided_eager("nothing_to_fuse", idle.reason() + " (found before, from Kiln's cache)")
        data = records.get(region_choice.CHOICE_FILE) if self._may_measure(args, kwargs) else None
        if data is None:
            return False
        try:
            timing = region_choice.RegionTiming.from_bytes(data, f"the stored choice of region {self.region.name}")
        except ValueError as exc:
            log.warning("Kiln: %s: ignored %s; the region is measured again", self.label, exc)
            return False
        self._decide(timing, " (measured before, from Kiln's cache)")
        if self.state is not RegionState.EAGER:
            return False
        self.backend.report(f"kept eager: {self.why_eager}", 1, 1)
        return True

    def _class_verdict(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """The first regions of its block class gained too little compiled (region_choice.ClassVerdicts)."""
        why = self.verdicts.predicted_eager(self.region.block_class)
        device = self._may_measure(args, kwargs) if why else None
        return device is not None and gpu_choice.judged_by_class(device) and self._decided_eager("class", why)

    def _cpu_rule(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """Its block is one that runs no faster compiled on this device (cpu.eager_before_capture)."""
        device = self._may_measure(args, kwargs)
        why = cpu.eager_before_capture(block, device) if device else ""
        return bool(why) and self._decided_eager("convolutions", why)

    def _decided_eager(self, kind: str, why: str) -> bool:
        """The region is decided eager before its first capture: said, counted and on the progress bar."""
        self._keep_eager(kind, why)
        self.backend.report(f"kept eager: {why}", 1, 1)
        return True

    # ---- decided by its first graph (the backend asks: CompileUnit.as_captured) ----------------------

    def _as_captured(self, gm: torch.fx.GraphModule, device: str, whole_block: bool) -> str:
        """Why to run this graph as captured: it gives Inductor nothing to fuse (compiler/regional/fusible.py),
        where the region may stay eager. When the graph is the block's whole code, the region runs
        eagerly from now on."""
        if not may_stay_eager(self.options, device) or not gpu_choice.runs_as_captured_when_idle(device):
            return ""
        idle = fusible.idle_record(gm)
        if idle is None:
            return ""
        if whole_block:
            self.idle = idle
            self.state, self.why_eager = RegionState.EAGER, idle.reason()
            self.stats.keep_eager(self.region.name, "nothing_to_fuse", idle.reason())
        return idle.reason()

    # ---- lowered in the background (compiler/regional/background.py) ------------------------------------

    def _eagerly_until_lowered(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        """A call before the region's code is ready: its block runs eagerly, and on the region's first
        call a copy of its inputs is handed to the model's lowering thread (or on a later one, while
        the inputs held for other regions fill MAX_HELD_BYTES). The deciders that need no other
        region's verdict decide here, on the model's thread, before any input is copied: a region they
        keep eager is never handed in. The class verdict waits on the thread for its class."""
        if self.state is RegionState.WAITING:
            if calls_position_patches(args, kwargs):
                log.info("Kiln: %s: region %s is lowered in the foreground, by this call: its blocks call the host's "
                         "patches (a patch may keep state, and lowering beside the model would call it once more)",
                         self.label, self.region.name)
                self.state = RegionState.NEW
                self.backend.progress = self.background.progress.for_region(self.region)
                return self(block, *args, **kwargs)
            if self._eager_before_capture(block, args, kwargs, [d for d in DECIDERS if not d.waits_for_class]):
                return module_calls.call_module_body(block, *args, **kwargs)
            self.state = RegionState.HELD_BACK
        if self.state is RegionState.HELD_BACK and self.background.thread.can_hold(HeldInputs.bytes_of(args, kwargs)):
            held, caller, shape = HeldInputs(args, kwargs), CallerState(), _call_shape.get()
            # a region of its class lowered before is measured first: this one may follow the class's verdict
            if self.background.thread.submit(self.region.name,
                                             lambda: self._lower_in_background(block, held, caller, shape),
                                             lambda: not self.background.measurement_due(self.region.block_class),
                                             held.nbytes):
                self.state = RegionState.HANDED
        return module_calls.call_module_body(block, *args, **kwargs)

    def _lower_in_background(self, block: torch.nn.Module, held: HeldInputs, caller: CallerState,
                             shape: Optional[CallShape]) -> None:
        """On the lowering thread: unless the region's class says eager, the region's first
        compiled call, on its first inputs, as the model's call would make it; from the model's next call
        of the region, its blocks run its code."""
        start = time.perf_counter()
        try:
            with caller.entered(), _call_shape_set(shape):  # the model call the inputs came from
                args, kwargs = held.given()
                if self._eager_before_capture(block, args, kwargs, [d for d in DECIDERS if d.waits_for_class]):
                    return
                self._run_compiled(block, args, kwargs)
            if self.idle is not None:
                self._store_idle(args, kwargs)
        except Exception as exc:  # noqa: BLE001  the block failed on its copied inputs: it runs eagerly, as it would
            self._fall_back(f"failed while lowered in the background ({type(exc).__name__}: {str(exc)[:300]})", exc)
        finally:
            if self.state is RegionState.HANDED:
                measurable = not self.timed and self.backend.graphs == 1 and self.options.measure_regions
                self.state = RegionState.MEASURE_DUE if measurable else RegionState.COMPILED
                if not measurable and not self.timed and self.options.measure_regions:
                    self._not_measured(f"its first call compiled {self.backend.graphs} graphs")
        how = f"runs eagerly: {self.why_eager}" if self.runs_eagerly else "its blocks run its code from their next call"
        log.info("Kiln: %s: region %s lowered in the background in %.1f s (%s); %s", self.label, self.region.name,
                 time.perf_counter() - start, self.background.done_line(), how)

    def _run_compiled(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        """One call of `block` through the region's compiled entry, with everything around it."""
        if self.mark_sizes:
            # a tensor inside a tuple, list or dict too: TorchDynamo guards on its sizes as on any other
            # (diffusers' Flux passes each block its rotary embedding as a (cos, sin) tuple sized by the tokens)
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):  # most inputs: no generator to walk
                    dynamo.allow_any_sizes(value)
                elif isinstance(value, (tuple, list, dict)):
                    for tensor in tensors_in(value, depth=3):
                        dynamo.allow_any_sizes(tensor)

        def call():
            with stand_ins(block):  # the host's layers TorchDynamo cannot trace run their traceable forward
                if not any(carries_position(v) for v in (*args, *kwargs.values())):
                    return self.compiled(block, *args, **kwargs)  # no position to hide: the common case, kept short
                with positions_hidden(args, kwargs) as (given_args, given_kwargs):
                    return self.compiled(block, *given_args, **given_kwargs)

        # compiler/graphs/fidelity_guard.py: its first compiled call at each input signature against eager
        check = region_check(self.fidelity, self.region.name, args, kwargs) \
            if self.fidelity is not None and not calls_position_patches(args, kwargs) else None
        out = self.backend.run(call, lambda: module_calls.call_module_body(block, *args, **kwargs), self._fall_back)
        if check is not None and self.state not in RUNS_EAGERLY:
            why, out = check.finish(self.fidelity, out, lambda a, k: module_calls.call_module_body(block, *a, **k),
                                    device_type_of((*args, *kwargs.values())))
            if why:
                self._keep_eager("fidelity", why)
        return out

    # ---- decided by measurement (compiler/regional/region_choice.py) ---------------------------------

    def _may_measure(self, args: tuple, kwargs: dict) -> Optional[str]:
        """The device the region runs on when its choice may be measured (and kept); else None."""
        device = device_type_of((*args, *kwargs.values()))
        return device if self.options.measure_regions and may_stay_eager(self.options, device) else None

    def _measure(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Right after the region's first graph compiled: time the call compiled and eagerly, keep the
        faster, and store the choice in the cache for later starts. Not measured (it stays compiled):
        a region that compiled more than one graph, or that holds a timing already."""
        if self.state in RUNS_EAGERLY:
            return
        self.state = RegionState.COMPILED
        device = self._may_measure(args, kwargs)
        if device is None or self.timed:
            return
        if self.backend.graphs != 1:
            self._not_measured(f"its first call compiled {self.backend.graphs} graphs")
            return
        why_not = region_choice.why_not_measured(block, calls_position_patches(args, kwargs))
        if why_not:
            if not self._not_measured(why_not):
                log.info("Kiln: %s: region %s is not measured against eager (%s); it stays compiled",
                         self.label, self.region.name, why_not)
            return
        graphs = self.backend.graphs
        try:
            timing = region_choice.time_both(lambda a, k: self._run_compiled(block, a, k),
                                             lambda a, k: module_calls.call_module_body(block, *a, **k), args, kwargs,
                                             device)
        except torch.cuda.OutOfMemoryError as exc:
            if not self._not_measured("the GPU ran out of memory while timing it"):
                log.warning("Kiln: %s: region %s is not measured against eager: the GPU ran out of memory while "
                            "timing it (%s); it stays compiled", self.label, self.region.name,
                            str(exc).splitlines()[0][:200])
            return
        if self.backend.graphs != graphs or self.state is RegionState.FAILED:
            if self.state is not RegionState.FAILED and self._not_measured("it compiled again while being measured"):
                return
            log.info("Kiln: %s: region %s compiled again while being measured; it stays compiled",
                     self.label, self.region.name)
            return
        self._decide(timing, "")
        if self.cache is not None:
            self.cache.write_record(self._choice_fields(args, kwargs, device), region_choice.CHOICE_FILE,
                                    timing.to_bytes())

    def _not_measured(self, why: str) -> bool:
        """A region whose choice could not be measured stays compiled, except glue compiled by `glue_regions:
        auto` (compiler/regional/glue.py): that is kept compiled only where it measured faster, so it runs
        eagerly, as it did before (then True)."""
        if not (self.region.glue and self.options.glue_regions == "auto"):
            return False
        self._keep_eager("unmeasured_glue", f"not measured against eager ({why}); glue_regions auto keeps glue "
                                            "compiled only where it measured faster")
        return True

    def _store_idle(self, args: tuple, kwargs: dict) -> None:
        """The region's block had nothing to fuse (its first capture said so): keep the verdict in
        Kiln's cache, so a later start runs it eagerly without capturing it (compiler/regional/fusible.py);
        say so if that leaves nothing compiled."""
        self._say_if_nothing_compiled()
        if self.cache is not None:
            device = device_type_of((*args, *kwargs.values()))
            self.cache.write_record(self._choice_fields(args, kwargs, device), fusible.IDLE_FILE, self.idle.to_bytes())

    def _decide(self, timing: region_choice.RegionTiming, source: str) -> None:
        self.stats.region_timings[self.region.name] = timing
        self.verdicts.record(self.region.block_class, self.region.name, timing)
        why = timing.reason()
        if why:
            self._keep_eager("measured", why + source)
        else:
            log.info("Kiln: %s: region %s stays compiled: %s%s", self.label, self.region.name, timing.line(), source)

    def _keep_eager(self, kind: str, why: str) -> None:
        self.state, self.why_eager = RegionState.EAGER, why
        self.stats.keep_eager(self.region.name, kind, why)
        log.info("Kiln: %s: region %s runs eagerly: %s", self.label, self.region.name, why)

    def _choice_fields(self, args: tuple, kwargs: dict, device: str) -> dict:
        return choice_fields(self.region.signature, (*args, *kwargs.values()), lowering_options(self.options), device,
                             f"{self.label} {self.region.name} choice")

    def _fall_back(self, reason: str, exc: BaseException) -> None:
        self.state, self.why_eager = RegionState.FAILED, reason
        self.stats.region_fallbacks[self.region.name] = reason
        message = (f"region {self.region.name} ({len(self.region.members)} block(s): {self.region.members[0]}...) "
                   f"{reason}; those blocks run eagerly from now on, the other regions stay compiled")
        self.stats.warnings.append(message)
        log.error("Kiln: %s: %s", self.label, message, exc_info=exc)
        self._say_if_nothing_compiled()

    def _say_if_nothing_compiled(self) -> None:
        """When every region has failed or runs eagerly by choice, and one failed, the model runs
        eagerly: the stats' fallback and the log say so, with the last failure."""
        stats = self.stats
        failures = stats.region_fallbacks
        if stats.fallback is None and failures and len(failures) + len(stats.regions_eager) >= len(stats.regions):
            name, reason = next(reversed(failures.items()))
            kept = f", {len(stats.regions_eager)} run eagerly by choice" if stats.regions_eager else ""
            stats.fallback = (f"no block region is compiled: {len(failures)} failed{kept} "
                              f"(the last to fail, {name}: {reason})")
            log.error("Kiln: %s -- %s runs eagerly from now on", stats.fallback, self.label)


# the rules that may decide a region eager before its first capture, in the order they are asked
DECIDERS = (
    Decider(waits_for_class=False, ask="_stored_choice"),
    Decider(waits_for_class=True, ask="_class_verdict"),
    Decider(waits_for_class=False, ask="_cpu_rule"),
)


class RegionProgress:
    """Turns each region's per-pass progress into one bar over all regions: regions done / total."""

    def __init__(self, total: int):
        self.total = total
        self.done: set[int] = set()
        self.callback: Optional[Progress] = None

    def for_region(self, region: Region) -> Progress:
        def progress(what: str, done: int, steps: int) -> None:
            if self.callback is None:
                return
            if done >= steps:
                self.done.add(region.index)
            finished = len(self.done)
            self.callback(f"region {min(finished + (done < steps), self.total)}/{self.total} {region.name}: {what}",
                          finished, self.total)
        return progress


class Background:
    """What the regions of one model lowered in the background share: the model's lowering thread, and
    the progress a region lowered in the foreground after all reports to."""

    def __init__(self, label: str, progress: RegionProgress):
        self.thread = LoweringThread(label)
        self.progress = progress
        self.regions: list[CompiledRegion] = []

    def measurement_due(self, block_class: str) -> bool:
        """A region of `block_class` lowered here waits for its next call to be measured against eager."""
        return any(region.state is RegionState.MEASURE_DUE and region.region.block_class == block_class
                   for region in self.regions)

    def done_line(self) -> str:
        done = sum(region.state not in BEFORE_LOWERED for region in self.regions)
        return f"{done} of {len(self.regions)} regions done"


def _background_here(label: str, stats) -> bool:
    """Whether this torch lets a region be lowered beside the model's call: with a torch that keeps
    its settings process-wide, the thread's capture would see the settings of whatever the model's
    thread is doing (dynamo.settings_per_thread). Said when not."""
    if dynamo.settings_per_thread():
        return True
    note = (f"background: this torch ({torch.__version__}) keeps its compile settings process-wide, not per "
            "thread, so a lowering beside the model's call could run under the model's settings of the moment; "
            "the regions are lowered in the foreground, by the calls that find them uncompiled")
    log.warning("Kiln: %s: %s", label, note)
    stats.warnings.append(note)
    return False


class RegionalCompile:
    """Every region of one model, compiled lazily, and the routing of its blocks' calls."""

    def __init__(self, regions: list[tuple[Region, list[torch.nn.Module]]], context: ModelContext):
        options, stats, label = context.options, context.stats, context.label
        self.progress = RegionProgress(len(regions))
        verdicts = region_choice.ClassVerdicts()
        self.background = Background(label, self.progress) if options.background and _background_here(label, stats) \
            else None
        self.regions = [CompiledRegion(region, context, self.progress, verdicts, self.background)
                        for region, _ in regions]
        if self.background is not None:
            self.background.regions = self.regions
        self._routes = {}
        self._paths = {}  # block path -> block, for the blocks a memory verdict keeps eager
        for compiled, (region, blocks) in zip(self.regions, regions):
            for path, block in zip(region.members, blocks):
                self._routes[block] = _route(compiled, block)
                self._paths[path] = block
        self._routes_without: dict = {frozenset(): self._routes}  # eager block paths -> the routes of the others
        stats.regions = [region for region, _ in regions]
        self._every_region_eager = False
        self.symbolic_sizes = options.symbolic_sizes
        self.specialises = options.pins_shapes  # pinned or bucket shapes get static variants of each region's graph
        self._first_batch: Optional[int] = None  # the batch of the model's first call with a latent
        self._stats, self._label = stats, label
        # graphs per code object: every position of the blocks (with attention patches installed), batch 1,
        # a branch or two; counted over all blocks, since where a block's graph breaks TorchDynamo resumes
        # in the model's own code, which every region's blocks share
        self.budget = 2 * sum(len(region.members) for region, _ in regions) + 4

    def use_fidelity_guard(self, guard) -> None:
        """Check each region's first compiled call at each input signature against eager (compiler/graphs)."""
        for region in self.regions:
            region.fidelity = guard

    def every_region_eager(self) -> bool:
        """Every region runs its blocks eagerly (by choice, or after its compile failed): the model's
        calls need no routing, and skip its cost. Neither is ever undone,
        so once true it stays true; a region not called yet is not decided, so a block that runs only
        at another size or with a ControlNet keeps the routing."""
        if not self._every_region_eager:
            self._every_region_eager = all(region.runs_eagerly for region in self.regions)
        return self._every_region_eager

    @contextlib.contextmanager
    def routed(self, progress: Optional[Progress], args: tuple = (), kwargs: Optional[dict] = None,
               eager_blocks: frozenset = frozenset()):
        """A context for one call of the model (`args`, `kwargs`): its blocks run through their regions,
        compiled with duck sizing off, no fake-tensor dispatch cache where sizes are symbolic, a
        recompile budget sized for the model's blocks and, where the shape policy specialises, the
        call's batch and latent for it to decide by. The blocks at `eager_blocks` (paths: those the host
        streams, compiler/memory_budget.py) are not routed: they run as they are, eagerly."""
        self.progress.callback = progress
        routes = self._routes_without.get(eager_blocks)
        if routes is None:
            if len(self._routes_without) >= MAX_EAGER_SETS:
                self._routes_without = {frozenset(): self._routes}
            eager = {self._paths[path] for path in eager_blocks if path in self._paths}
            routes = self._routes_without[eager_blocks] = {b: r for b, r in self._routes.items() if b not in eager}
        with module_calls.calls_routed(routes), dynamo.no_duck_sizing(), \
                dynamo.no_fake_dispatch_cache(self.symbolic_sizes), dynamo.recompile_limit_at_least(self.budget), \
                _call_shape_set(self._call_shape_of(args, kwargs or {}) if self.specialises else None):
            yield

    def _call_shape_of(self, args: tuple, kwargs: dict) -> Optional[CallShape]:
        latent = model_latent(args, kwargs)
        if latent is None:  # a DiT given packed tokens: no latent to match the shapes by
            note = ("shapes: the model's call has no 4-D or 5-D latent input (packed tokens?), so no pinned or bucket "
                    "shape can be matched: its regions get no static variants")
            if self._stats.warn_once(note):
                log.warning("Kiln: %s: %s", self._label, note)
            return None
        batch = latent.shape[0]
        if self._first_batch is None:
            self._first_batch = batch
        return CallShape(batch, (latent.shape[-2], latent.shape[-1]), self._first_batch)

    def wait_lowered(self, timeout: Optional[float] = None) -> bool:
        """Wait until the lowering thread has lowered every region it can now (compiler/regional/background.py);
        False when `timeout` (seconds) ran out first."""
        return self.background is None or self.background.thread.wait(timeout)

    def waiting_regions(self) -> list[str]:
        """The regions whose blocks run eagerly until they are lowered in the background: queued on the
        lowering thread, being lowered, or not yet handed in (not called yet, or their inputs held back
        by MAX_HELD_BYTES)."""
        return [region.region.name for region in self.regions if region.state in BEFORE_LOWERED]


@contextlib.contextmanager
def _call_shape_set(shape: Optional[CallShape]):
    token = _call_shape.set(shape)
    try:
        yield
    finally:
        _call_shape.reset(token)


def _route(compiled: CompiledRegion, block: torch.nn.Module):
    def call(*args, **kwargs):
        return compiled(block, *args, **kwargs)
    return call
