"""A model compiled by blocks: one compiled entry per region, and the guard around every block call.

`RegionalCompile` holds, for one KilnModel, a `CompiledRegion` per distinct block (compiler/regional/blocks.py).
Each has an entry function with a code object of its own (TorchDynamo keeps graphs and counts its
recompile limit per code object, so every region of every model has its own budget) and a
KilnBackend of its own, sharing the model's stats, cache and CUDA graph budget. While the model runs
(`routed()`), a call of any block goes to its region's compiled entry with the block itself as an
argument: its parameters are graph inputs, so the blocks of one region share the graphs and each
reads its own live weights (LoRA and in-place patches show up without a recompile).

What tells identical blocks apart is left out of their graph where nothing reads it: ComfyUI passes
each block its position (`transformer_options["block"] = ("input", 4)`, `block_index`), which its
attention code looks up in the (empty) dict of attention patches, so TorchDynamo would guard on it
and compile the region again for every position. When no patch the block itself calls is installed
(BLOCK_PATCHES, `patches_replace`; FreeU's patches run between blocks) the block sees a neutral
position instead, and what it writes into the dict is copied back; with such patches, the real
position goes in (a patch may depend on it), each position compiles once, and the recompile budget
is sized for the model's blocks.

A region whose block is one graph with nothing for Inductor to fuse (a lone convolution, a resize
and a convolution: compiler/regional/fusible.py) runs its first call as captured and its blocks eagerly from
then on (`stats.regions_eager`, with the reason): lowering it would cost a build and gain nothing,
and every call of a compiled block pays TorchDynamo's entry and guards (~0.1 ms on a CPU).

A region with something to fuse is timed on its first call, right after it compiled, compiled and
eagerly on copies of the same inputs, and stays compiled only where that is faster
(compiler/regional/region_choice.py): on a CPU most of SD1.5's ResNet blocks are not. The choice is kept in
Kiln's cache, so a later start never captures a region measured slower; and once the first regions
of a block class gained less than 10% compiled, the class's other regions are not compiled at all.

Per region, as the whole model has it: the first call compiles (with the region named in the
progress, the log and the stats); a failed compile sends that region, and only it, to eager with the
reason logged and kept (`stats.region_fallbacks`); a cancel from the progress callback propagates
untouched and keeps nothing of the half-done compile.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from typing import Optional

import torch

from .. import compat
from . import fusible, region_choice
from .background import CallerState, HeldInputs, LoweringThread
from ..backend.dynamo_backend import KilnBackend, device_type_of, lowering_options
from .blocks import Region
from ..cache import GraphCache, choice_fields
from ..shapes.cuda_graph_budget import CudaGraphBudget
from ..options.compile_options import CompileOptions
from ..passes import Progress
from ..shapes.shape_manager import CallShape
from ..shapes.inputs import contiguous_inputs, model_latent, tensors_in
from ..stats import KilnStats

log = logging.getLogger("kiln")

# the model call the regions' blocks run in, where the shape policy specialises (RegionalCompile.routed);
# a context variable, so that the lowering thread can set the call of the inputs it lowers on
_call_shape: contextvars.ContextVar[Optional[CallShape]] = contextvars.ContextVar("kiln_call_shape", default=None)


def current_call_shape() -> Optional[CallShape]:
    return _call_shape.get()


class CompiledRegion:
    """One region's compiled entry and the guard every call of one of its blocks goes through."""

    def __init__(self, region: Region, options: CompileOptions, stats: KilnStats, cache: Optional[GraphCache],
                 label: str, cuda_graph_budget: Optional[CudaGraphBudget], progress: "RegionProgress",
                 verdicts: region_choice.ClassVerdicts, background: Optional["Background"] = None):
        self.region = region
        self.verdicts = verdicts  # what this model's regions measured, per block class
        self.stats = stats
        self.label = label
        self.options = options
        self.cache = cache
        self.fallback: Optional[str] = None
        self.decided = False  # compiled or eager was measured, or read from the cache: not measured again
        entry = compat.own_code(compat.call_module_body, f"kiln_{label}_{region.name}".replace(".", "_").replace("#", "_"))
        self.code = entry.__code__
        self.backend = KilnBackend(options, stats, code=self.code, cache=cache, label=f"{label} {region.name}",
                                   region=region.name, cuda_graph_budget=cuda_graph_budget,
                                   call_shape=current_call_shape)
        # lowered in the background (compiler/regional/background.py): "waiting" to be handed to the model's
        # lowering thread, "handed" to it, "done" (compiled, or eager by choice or failure); None: in
        # the foreground, by the call that finds it uncompiled
        self.background = background
        self.lowered_in_background: Optional[str] = "waiting" if background is not None else None
        # the rules decided before a hand-in (a stored choice, the convolution rule) were asked: a
        # region whose inputs wait past MAX_HELD_BYTES does not read the cache again at every call
        self.asked_before_hand_in = False
        # lowered in the background: its next call with the lowering thread idle measures it
        # (compiler/regional/region_choice.py); until then the thread lowers no other region of its class
        self.measure_due = False
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
        self.mark_sizes = options.dynamic is None
        self.compiled = torch.compile(entry, backend=self.backend, dynamic=options.dynamic, fullgraph=options.fullgraph)

    @property
    def runs_eagerly(self) -> bool:
        """Its blocks run eagerly from now on: by choice, or after its compile failed (never undone)."""
        return self.fallback is not None or self.backend.kept_eager is not None

    def __call__(self, block: torch.nn.Module, *args, **kwargs):
        if self.runs_eagerly:
            return compat.call_module_body(block, *args, **kwargs)
        args, kwargs = contiguous_inputs(args, kwargs)
        first = self.backend.graphs == 0
        if self.lowered_in_background not in (None, "done"):
            return self._eagerly_until_lowered(block, args, kwargs)
        if first and not self.decided and (self._eager_by_stored_choice(args, kwargs)
                                           or self._eager_by_class(args, kwargs)
                                           or self._eager_by_convolutions(block, args, kwargs)):
            self._say_if_nothing_compiled()
            return compat.call_module_body(block, *args, **kwargs)
        out = self._run_compiled(block, args, kwargs)
        if first and self.backend.kept_idle is not None:
            self._store_idle(args, kwargs)
        measure = first
        if self.measure_due and not self.background.thread.busy():  # timed beside a lowering, it would mislead
            measure, self.measure_due = True, False
        if measure and not self.decided and self.backend.graphs == 1 and self.backend.kept_eager is None:
            self._measure(block, args, kwargs)
        if measure and self.background is not None:
            self.background.thread.wake()  # the regions of its class that waited for the verdict
        if self.backend.kept_eager is not None:  # decided in this call: the last region compiled may be gone
            self._say_if_nothing_compiled()
        return out

    # ---- lowered in the background (compiler/regional/background.py) ------------------------------------

    def _eagerly_until_lowered(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        """A call before the region's code is ready: its block runs eagerly, and on the region's first
        call a copy of its inputs is handed to the model's lowering thread (or on a later one, while
        the inputs held for other regions fill MAX_HELD_BYTES). A region that a choice stored in
        Kiln's cache or the convolution rule keeps eager is decided here, on the model's thread: it
        is never handed in. The class rule waits on the thread for the verdict of its class."""
        if self.lowered_in_background == "waiting":
            if any(_carries_position(v) and _patches_read_position(v) for v in (*args, *kwargs.values())):
                log.info("Kiln: %s: region %s is lowered in the foreground, by this call: its blocks call ComfyUI "
                         "patches (a patch may keep state, and lowering beside the model would call it once more)",
                         self.label, self.region.name)
                self.lowered_in_background = None
                self.backend.progress = self.background.progress.for_region(self.region)
                return self(block, *args, **kwargs)
            # what needs no other region's verdict is decided here, before any input is copied and held
            if not self.asked_before_hand_in:
                self.asked_before_hand_in = True
                if not self.decided and (self._eager_by_stored_choice(args, kwargs)
                                         or self._eager_by_convolutions(block, args, kwargs)):
                    self.lowered_in_background = "done"
                    self._say_if_nothing_compiled()
                    return compat.call_module_body(block, *args, **kwargs)
            if self.background.thread.can_hold(HeldInputs.bytes_of(args, kwargs)):  # else asked again at a later call
                held, caller, shape = HeldInputs(args, kwargs), CallerState(), _call_shape.get()
                # a region of its class lowered before is measured first: this one may follow the class's verdict
                if self.background.thread.submit(self.region.name,
                                                 lambda: self._lower_in_background(block, held, caller, shape),
                                                 lambda: not self.background.measurement_due(self.region.block_class),
                                                 held.nbytes):
                    self.lowered_in_background = "handed"
        return compat.call_module_body(block, *args, **kwargs)

    def _lower_in_background(self, block: torch.nn.Module, held: HeldInputs, caller: CallerState,
                             shape: Optional[CallShape]) -> None:
        """On the lowering thread: unless the region's class says eager, the region's first
        compiled call, on its first inputs, as the model's call would make it; from the model's next call
        of the region, its blocks run its code."""
        start = time.perf_counter()
        try:
            with caller.entered(), _call_shape_set(shape):  # the model call the inputs came from
                args, kwargs = held.given()
                if not self.decided and self._eager_by_class(args, kwargs):  # the other rules decided at the hand-in
                    self._say_if_nothing_compiled()
                    return
                self._run_compiled(block, args, kwargs)
            if self.backend.kept_idle is not None:
                self._store_idle(args, kwargs)
        except Exception as exc:  # noqa: BLE001  the block failed on its copied inputs: it runs eagerly, as it would
            self._fall_back(f"failed while lowered in the background ({type(exc).__name__}: {str(exc)[:300]})", exc)
        finally:
            self.measure_due = (not self.decided and not self.runs_eagerly and self.backend.graphs == 1
                                and self.options.measure_regions)
            self.lowered_in_background = "done"
        how = ("runs eagerly: " + (self.fallback or self.backend.kept_eager)) if self.runs_eagerly \
            else "its blocks run its code from their next call"
        log.info("Kiln: %s: region %s lowered in the background in %.1f s (%s); %s", self.label, self.region.name,
                 time.perf_counter() - start, self.background.done_line(), how)

    def _run_compiled(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        """One call of `block` through the region's compiled entry, with everything around it."""
        if self.mark_sizes:
            # a tensor inside a tuple, list or dict too: TorchDynamo guards on its sizes as on any other
            # (diffusers' Flux passes each block its rotary embedding as a (cos, sin) tuple sized by the tokens)
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):  # most inputs: no generator to walk
                    compat.allow_any_sizes(value)
                elif isinstance(value, (tuple, list, dict)):
                    for tensor in tensors_in(value, depth=3):
                        compat.allow_any_sizes(tensor)

        def call():
            if not any(_carries_position(v) for v in (*args, *kwargs.values())):
                return self.compiled(block, *args, **kwargs)  # no position to hide: the common case, kept short
            with positions_hidden(args, kwargs) as (given_args, given_kwargs):
                return self.compiled(block, *given_args, **given_kwargs)

        return self.backend.run(call, lambda: compat.call_module_body(block, *args, **kwargs), self._fall_back)

    # ---- compiled or eager, by measurement (compiler/regional/region_choice.py) -------------------------

    def _may_measure(self, args: tuple, kwargs: dict) -> Optional[str]:
        """The device the region runs on when its choice may be measured (and kept); else None."""
        device = device_type_of((*args, *kwargs.values()))
        return device if self.options.measure_regions and self.backend.may_keep_eager(device) else None

    def _measure(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Right after the region's first graph compiled: time the call compiled and eagerly, keep the
        faster, and store the choice in the cache for later starts."""
        self.decided = True
        device = self._may_measure(args, kwargs)
        if device is None or self.fallback is not None:
            return
        patched = any(_carries_position(v) and _patches_read_position(v)
                      for v in (*args, *kwargs.values()))
        why_not = region_choice.why_not_measured(block, patched)
        if why_not:
            log.info("Kiln: %s: region %s is not measured against eager (%s); it stays compiled",
                     self.label, self.region.name, why_not)
            return
        graphs = self.backend.graphs
        try:
            timing = region_choice.time_both(lambda a, k: self._run_compiled(block, a, k),
                                             lambda a, k: compat.call_module_body(block, *a, **k), args, kwargs, device)
        except torch.cuda.OutOfMemoryError as exc:
            log.warning("Kiln: %s: region %s is not measured against eager: the GPU ran out of memory while "
                        "timing it (%s); it stays compiled", self.label, self.region.name, str(exc).splitlines()[0][:200])
            return
        if self.backend.graphs != graphs or self.fallback is not None:
            log.info("Kiln: %s: region %s compiled again while being measured; it stays compiled",
                     self.label, self.region.name)
            return
        self._decide(timing, "")
        if self.cache is not None:
            self.cache.write_record(self._choice_fields(args, kwargs, device), region_choice.CHOICE_FILE,
                                    timing.to_bytes())

    def _store_idle(self, args: tuple, kwargs: dict) -> None:
        """The region's block had nothing to fuse (its first capture said so): keep the verdict in
        Kiln's cache, so a later start runs it eagerly without capturing it (compiler/regional/fusible.py)."""
        if self.cache is not None:
            device = device_type_of((*args, *kwargs.values()))
            self.cache.write_record(self._choice_fields(args, kwargs, device), fusible.IDLE_FILE,
                                    self.backend.kept_idle.to_bytes())

    def _eager_by_stored_choice(self, args: tuple, kwargs: dict) -> bool:
        """Before the region's first capture: whether Kiln's cache holds, for these inputs here, the
        verdict that the block has nothing to fuse, or a choice measured before that says eager (then
        nothing is captured)."""
        device = device_type_of((*args, *kwargs.values())) if self.cache is not None else None
        if device is None or not self.backend.may_keep_eager(device):
            return False
        records = self.cache.read_records(self._choice_fields(args, kwargs, device))
        if fusible.IDLE_FILE in records:
            try:
                idle = fusible.IdleRecord.from_bytes(records[fusible.IDLE_FILE],
                                                     f"the stored verdict of region {self.region.name}")
            except ValueError as exc:
                log.warning("Kiln: %s: ignored %s; the region is captured again", self.label, exc)
            else:
                self.decided = True
                self._keep_eager("nothing_to_fuse", idle.reason() + " (found before, from Kiln's cache)")
                self.backend.report(f"kept eager: {self.backend.kept_eager}", 1, 1)
                return True
        data = records.get(region_choice.CHOICE_FILE) if self._may_measure(args, kwargs) else None
        if data is None:
            return False
        try:
            timing = region_choice.RegionTiming.from_bytes(data, f"the stored choice of region {self.region.name}")
        except ValueError as exc:
            log.warning("Kiln: %s: ignored %s; the region is measured again", self.label, exc)
            return False
        self.decided = True
        self._decide(timing, " (measured before, from Kiln's cache)")
        if self.backend.kept_eager is None:
            return False
        self.backend.report(f"kept eager: {self.backend.kept_eager}", 1, 1)
        return True

    def _eager_by_class(self, args: tuple, kwargs: dict) -> bool:
        """Before the region's first capture: whether the first regions of its block class gained too
        little compiled (region_choice.ClassVerdicts); then it is not compiled."""
        why = "" if self.decided else self.verdicts.predicted_eager(self.region.block_class)
        if not why or self._may_measure(args, kwargs) is None:
            return False
        return self._eager_before_capture("class", why)

    def _eager_by_convolutions(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """Before the region's first capture, with nothing measured or stored for it: whether its block
        is one that runs no faster compiled on this device (region_choice.convolutions_on_cpu)."""
        device = None if self.decided else self._may_measure(args, kwargs)
        why = region_choice.convolutions_on_cpu(block, device) if device else ""
        if not why:
            return False
        return self._eager_before_capture("convolutions", why)

    def _eager_before_capture(self, kind: str, why: str) -> bool:
        """The region is decided eager before its first capture: said, counted and on the progress bar."""
        self.decided = True
        self._keep_eager(kind, why)
        self.backend.report(f"kept eager: {why}", 1, 1)
        return True

    def _decide(self, timing: region_choice.RegionTiming, source: str) -> None:
        self.stats.region_timings[self.region.name] = timing
        self.verdicts.record(self.region.block_class, self.region.name, timing)
        why = timing.reason()
        if why:
            self._keep_eager("measured", why + source)
        else:
            log.info("Kiln: %s: region %s stays compiled: %s%s", self.label, self.region.name, timing.line(), source)

    def _keep_eager(self, kind: str, why: str) -> None:
        self.backend.kept_eager = why
        self.stats.keep_eager(self.region.name, kind, why)
        log.info("Kiln: %s: region %s runs eagerly: %s", self.label, self.region.name, why)

    def _choice_fields(self, args: tuple, kwargs: dict, device: str) -> dict:
        return choice_fields(self.region.signature, (*args, *kwargs.values()), lowering_options(self.options), device,
                             f"{self.label} {self.region.name} choice")

    def _fall_back(self, reason: str, exc: BaseException) -> None:
        self.fallback = reason
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


# ComfyUI's transformer_options: the keys that say where a block sits, each with the neutral value a
# block sees when no patch is installed; the keys a block writes for patches to read (its input's
# shape); the keys that hold patches. Without a patch nothing reads the first two kinds.
POSITION_KEYS = {"block": ("", 0), "block_index": 0, "transformer_index": 0}
SCRATCH_KEYS = ("activations_shape",)
# the patches a block itself calls with its position (attention replacements are keyed by it); the
# others (FreeU's output_block_patch, input_block_patch, ...) run in the glue between blocks
BLOCK_PATCHES = ("attn1_patch", "attn2_patch", "attn1_output_patch", "attn2_output_patch", "middle_patch")


@contextlib.contextmanager
def positions_hidden(args, kwargs):
    """(args, kwargs) with each transformer_options dict (one with a "block" key) replaced by a copy
    when it holds no patch a block calls (BLOCK_PATCHES, patches_replace): every POSITION_KEYS key
    set to its neutral value and no SCRATCH_KEYS, so every block of a region passes the same keys
    and values. After the call, the other keys the block wrote into the copy go into the original."""
    swapped = []

    def hide(value):
        if not _carries_position(value) or _patches_read_position(value):
            return value
        copy = {key: item for key, item in value.items() if key not in SCRATCH_KEYS}
        copy.update(POSITION_KEYS)
        swapped.append((value, copy, dict(copy)))
        return copy

    new_args, new_kwargs = tuple(hide(a) for a in args), {k: hide(v) for k, v in kwargs.items()}
    yield new_args, new_kwargs
    for original, copy, given in swapped:
        for key, item in copy.items():
            if key not in POSITION_KEYS and key not in SCRATCH_KEYS and (key not in given or given[key] is not item):
                original[key] = item


def _carries_position(value) -> bool:
    """A ComfyUI transformer_options dict: one that says where the block sits."""
    return isinstance(value, dict) and "block" in value


def _patches_read_position(options: dict) -> bool:
    patches = options.get("patches") or {}
    return bool(options.get("patches_replace")) or any(patches.get(key) for key in BLOCK_PATCHES)


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
        return any(region.measure_due and region.region.block_class == block_class for region in self.regions)

    def done_line(self) -> str:
        done = sum(region.lowered_in_background == "done" for region in self.regions)
        return f"{done} of {len(self.regions)} regions done"


def _background_here(label: str, stats: KilnStats) -> bool:
    """Whether this torch lets a region be lowered beside the model's call: with a torch that keeps
    its settings process-wide, the thread's capture would see the settings of whatever the model's
    thread is doing (compat.settings_per_thread). Said when not."""
    if compat.settings_per_thread():
        return True
    note = (f"background: this torch ({torch.__version__}) keeps its compile settings process-wide, not per "
            "thread, so a lowering beside the model's call could run under the model's settings of the moment; "
            "the regions are lowered in the foreground, by the calls that find them uncompiled")
    log.warning("Kiln: %s: %s", label, note)
    stats.warnings.append(note)
    return False


class RegionalCompile:
    """Every region of one model, compiled lazily, and the routing of its blocks' calls."""

    def __init__(self, regions: list[tuple[Region, list[torch.nn.Module]]], options: CompileOptions, stats: KilnStats,
                 cache: Optional[GraphCache], label: str, cuda_graph_budget: Optional[CudaGraphBudget] = None):
        self.progress = RegionProgress(len(regions))
        verdicts = region_choice.ClassVerdicts()
        self.background = Background(label, self.progress) if options.background and _background_here(label, stats) \
            else None
        self.regions = [CompiledRegion(region, options, stats, cache, label, cuda_graph_budget, self.progress, verdicts,
                                       self.background)
                        for region, _ in regions]
        if self.background is not None:
            self.background.regions = self.regions
        self._routes = {}
        for compiled, (_, blocks) in zip(self.regions, regions):
            for block in blocks:
                self._routes[block] = _route(compiled, block)
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

    def every_region_eager(self) -> bool:
        """Every region runs its blocks eagerly (by choice, or after its compile failed): the model's
        calls need no routing, and skip its cost (about 0.1 ms a call on a CPU). Neither is ever undone,
        so once true it stays true; a region not called yet is not decided, so a block that runs only
        at another size or with a ControlNet keeps the routing."""
        if not self._every_region_eager:
            self._every_region_eager = all(region.runs_eagerly for region in self.regions)
        return self._every_region_eager

    @contextlib.contextmanager
    def routed(self, progress: Optional[Progress], args: tuple = (), kwargs: Optional[dict] = None):
        """A context for one call of the model (`args`, `kwargs`): its blocks run through their regions,
        compiled with duck sizing off, no fake-tensor dispatch cache where sizes are symbolic, a
        recompile budget sized for the model's blocks and, where the shape policy specialises, the
        call's batch and latent for it to decide by."""
        self.progress.callback = progress
        with compat.calls_routed(self._routes), compat.no_duck_sizing(), \
                compat.no_fake_dispatch_cache(self.symbolic_sizes), compat.recompile_limit_at_least(self.budget), \
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
        return [region.region.name for region in self.regions
                if region.lowered_in_background in ("waiting", "handed") and not region.runs_eagerly]


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
