"""`KilnModel`: one diffusion model, its Kiln plan, and the guard every call goes through.

A KilnModel wraps the original module (which keeps owning its weights) and executes its plan
lazily, on the first call: today the plan's one step is compile (`torch.compile` with Kiln's
backend). Every caller, ComfyUI's wrapper or Python code, calls the KilnModel, and it:

- runs the compiled model; if compiling fails, it logs why, records it in `stats.fallback` and
  runs this call and every later one eagerly (the queue goes on);
- if the caller's progress callback raises during a compile (ComfyUI's cancel), re-raises that
  exception untouched and keeps nothing of the half-done compile: the next call compiles again;
- marks what the sampler changes between prompts as dynamic (batch, resolution, the length of
  the sigma schedule ComfyUI passes down), so those changes do not recompile;
- says once when the model is on CUDA and Triton is missing (Kiln's kernels then run their
  torch references).

What it compiles is the plan's `compile_unit`: by blocks (each distinct block once, identical blocks
sharing its code, the glue between blocks eager, or on CUDA regions of its own: compiler/regional/blocks.py,
compiler/regional/glue.py, compiler/regional/regional_compile.py), the
default for a model that repeats blocks, or the whole model as one graph.

`model_for(module, plan)` returns the one KilnModel of that module and plan: running the same plan
on the same module again reuses its compiled graphs, and a changed plan compiles once, with a log
line saying what changed. The memo lives in the module's own `__dict__` and TorchDynamo's compiled
graphs live on a code object of this KilnModel's own, so everything goes with the model: no
global table keeps a dropped model's graphs, shape variants or stats alive.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .torch_compat import dynamo, versions
from .backend.context import CompileUnit, ModelContext
from .backend.dynamo_backend import KilnBackend
from .regional import glue
from .regional.blocks import find_blocks, has_repeated_blocks, regions_of
from .memory_budget import MemoryVerdict
from .cache import GraphCache
from .graphs.fidelity_guard import region_check
from .graphs.for_model import graphs_for_model
from .host_layers import stand_ins
from .shapes.cuda_graph_budget import CudaGraphBudget
from .method import label_of
from .passes import Progress
from .plan import KilnPlan
from .regional.regional_compile import RegionalCompile
from .shapes.inputs import contiguous_inputs, input_shapes, mark_batch_and_resolution_dynamic, mark_schedule_dynamic
from .stats import KilnStats

log = logging.getLogger("kiln")

_MEMO = "_kiln_models"        # module.__dict__: {plan key: KilnModel}
_LAST_PLAN = "_kiln_last_plan"  # module.__dict__: the plan most recently asked for, to say what changed
WHOLE_MODEL = "whole model"     # compiled whole: the fidelity guard's name for its one region


WHOLE_PARTLY_LOADED = ("the model compiles whole, so the blocks its host streams are in the graph with the host's "
                       "casts of their weights (by blocks they would run eagerly, through the host's own offload path)")


class KilnUnavailable(RuntimeError):
    """This environment cannot run Kiln's compiler (e.g. torch too old); the message says why."""


def unavailable_reason() -> Optional[str]:
    """Why Kiln cannot compile here (torch too old), or None."""
    return versions.torch_version_problem()


def kernel_note(device: str) -> str:
    """What a user should know about Kiln's kernels on this device ("" if nothing)."""
    from ..kernels import triton_available

    if str(device).startswith("cuda") and not triton_available():
        return "Triton is not installed: Kiln's kernels run their torch references (slower); install triton for full speed."
    return ""


def model_for(module: torch.nn.Module, plan: KilnPlan, progress: Optional[Progress] = None) -> "KilnModel":
    """The KilnModel of `module` under `plan`, made on first request. `progress` becomes its callback."""
    if isinstance(module, KilnModel):
        module = module.original
    models = module.__dict__.setdefault(_MEMO, {})
    key = plan.key
    model = models.get(key)
    if model is None:
        last = module.__dict__.get(_LAST_PLAN)
        if last is not None and last.key != key:
            log.info("Kiln: %s has a new plan (%s); it compiles once for it", label_of(module),
                     "; ".join(plan.changes_from(last)))
        model = models[key] = KilnModel(module, plan)
    module.__dict__[_LAST_PLAN] = plan
    model.progress = progress
    return model


def _entry(module, *args, **kwargs):
    return module(*args, **kwargs)


class KilnModel(torch.nn.Module):
    """One diffusion model under a Kiln plan; call it like the model. See the module docstring."""

    def __init__(self, module: torch.nn.Module, plan: KilnPlan):
        super().__init__()
        self._orig_mod = module
        self.plan = plan
        self.progress: Optional[Progress] = None
        self.stats = KilnStats(options=plan.compile.as_dict() if plan.compile else {})
        self._compiled = None           # the torch.compile'd entry function, made on the first call
        self._backend: Optional[KilnBackend] = None
        self._regions: Optional[RegionalCompile] = None  # compiled by blocks: the regions, made on the first call
        # with cuda_graphs on, what bounds the recordings: the model's input shapes (compiler/shapes/cuda_graph_budget.py)
        self._cuda_graphs: Optional[CudaGraphBudget] = None
        # with cuda_graphs auto on a CUDA device: the whole call recorded and replayed (compiler/graphs)
        self._whole_call = None
        # the host's memory verdict for the calls from now on (compiler/memory_budget.py; use_memory)
        self.memory = MemoryVerdict(fits=True)
        self._eager_blocks: frozenset = frozenset()

    @property
    def original(self) -> torch.nn.Module:
        return self._modules["_orig_mod"]

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)  # dtype, config, ...: the model's own

    def wait_lowered(self, timeout: Optional[float] = None) -> list[str]:
        """Wait for the lowering thread, if any; the regions still waiting (compiler/regional/background.py;
        kiln.wait_lowered)."""
        if self._regions is None:
            return []
        self._regions.wait_lowered(timeout)
        return self._regions.waiting_regions()

    def use_memory(self, verdict: MemoryVerdict) -> None:
        """The host's memory verdict (compiler/memory_budget.py) for the calls from now on: its blocks with
        streamed weights run eagerly, and no whole-call CUDA graph records where it says so. Each new reason
        is said once, in the log and the stats' warnings; `stats.memory` keeps the verdict in force."""
        if verdict.why and self.stats.warn_once(f"memory: {verdict.why}"):
            log.warning("Kiln: %s: %s", label_of(self.original), verdict.why)
        self.memory = self.stats.memory = verdict
        self._eager_blocks = frozenset(verdict.eager_blocks)

    def blocks(self) -> list:
        """(path, block) for the model's blocks, as its compile by blocks finds them (compiler/regional/blocks.py):
        the paths a memory verdict names."""
        return find_blocks(self.original)

    # ---- the call guard --------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        module = self.original
        compiled = None if self.stats.fallback else self._compiled or self._regions or self._prepare()
        if compiled is not None and compiled is self._compiled and self.memory.eager_blocks:
            # compiled whole, no block can be left out of the graph: the host's casts of its streamed layers are in it
            if self.stats.warn_once(WHOLE_PARTLY_LOADED):
                log.info("Kiln: %s: %s", label_of(module), WHOLE_PARTLY_LOADED)
        return self._call(compiled, module, args, kwargs)

    def _call(self, compiled, module, args, kwargs):
        if compiled is None:
            return module(*args, **kwargs)
        if self._whole_call is not None and self.memory.cuda_graphs:
            return self._whole_call(lambda a, k: self._run(compiled, module, a, k), args, kwargs)
        if self._cuda_graphs is not None:
            with self._cuda_graphs.for_call(input_shapes(args, kwargs)):
                return self._cuda_graphs.owned(self._run(compiled, module, args, kwargs))
        return self._run(compiled, module, args, kwargs)

    def _run(self, compiled, module, args, kwargs):
        if compiled is self._regions:
            if compiled.every_region_eager():
                return module(*args, **kwargs)
            with self._regions.routed(self.progress, args, kwargs, self._eager_blocks):
                return module(*args, **kwargs)
        args, kwargs = contiguous_inputs(args, kwargs)
        mark_schedule_dynamic(args, kwargs)
        if self.plan.compile.dynamic is None:  # auto: batch and resolution dynamic from the first compile
            mark_batch_and_resolution_dynamic(args, kwargs)
        backend = self._backend
        backend.progress = self.progress
        # with whole-call graphs: the compiled model's first call at each input signature against eager (compiler/graphs)
        check = region_check(self._whole_call.guard, WHOLE_MODEL, args, kwargs) if self._whole_call is not None else None
        # a faster capture (dynamo.no_fake_dispatch_cache's docstring says when); ComfyUI's layers traceable (host_layers.py)
        with dynamo.no_fake_dispatch_cache(self.plan.compile.symbolic_sizes), stand_ins(module):
            out = backend.run(lambda: compiled(module, *args, **kwargs), lambda: module(*args, **kwargs),
                              self._fall_back)
        if check is not None and not self.stats.fallback:
            why, out = check.finish(self._whole_call.guard, out, lambda a, k: module(*a, **k), _device_of(module))
            if why:
                self._fall_back(f"the compiled model: {why}")
        return out

    def _prepare(self):
        """Execute the plan's steps (STEPS order). None, and the model runs eagerly, if there is nothing
        to compile or the compile cannot be set up here (said loudly, in the log and stats.fallback)."""
        if self.plan.compile is None:
            return None
        try:
            return self._set_up_compile()
        except Exception as exc:  # noqa: BLE001  e.g. TorchDynamo cannot load here: the model still runs
            self._fall_back(f"cannot set up the compile ({type(exc).__name__}: {exc})", exc)
            return None

    def _set_up_compile(self):
        problem = unavailable_reason()
        if problem:
            self._fall_back(problem)
            return None
        options = self.plan.compile
        module = self.original
        module.requires_grad_(False)  # inference: a patched weight installed later must not fail a guard
        note = kernel_note(_device_of(module))
        if note:
            log.warning("Kiln: %s", note)
            self.stats.warnings.append(note)
        cache = GraphCache(self.plan.cache) if self.plan.cache is not None else None
        note = self.plan.cache_unused()
        if note:
            log.info("Kiln: %s", note)
            self.stats.warnings.append(note)
        label = label_of(module)
        if options.cuda_graphs:
            self._cuda_graphs = CudaGraphBudget(options.shapes.max_cuda_graphs)
        context = ModelContext(options, self.stats, cache, label, self._cuda_graphs)
        regions = self._blocks_to_compile(module)
        if regions:  # by blocks: the glue between them too, where glue_regions says (compiler/regional/glue.py)
            regions = regions + glue.glue_regions(module, regions, options, glue.model_device(module), label)
        if options.background and not regions:
            note = "background: the model compiles whole (above), as one graph that its first call waits for"
            log.warning("Kiln: %s %s", label, note)
            self.stats.warnings.append(note)
        device = str(next(module.parameters(), torch.empty(0)).device)
        if options.whole_call_graphs(device):
            self._whole_call = graphs_for_model(module, options, self.stats, label, device,
                                                lambda: self._regions.waiting_regions() if self._regions else [])
        if regions:
            self._regions = RegionalCompile(regions, context)
            if self._whole_call is not None:
                self._regions.use_fidelity_guard(self._whole_call.guard)
            log.info("Kiln: %s compiles by blocks: %s", label, self.stats.units_line())
            return self._regions
        # not the model class's forward, shared by every model of the class (the 9th would run eagerly)
        entry = dynamo.own_code(_entry, f"kiln_{label.replace('.', '_')}")
        self._backend = KilnBackend(context, CompileUnit(code=entry.__code__))
        self._compiled = torch.compile(entry, backend=self._backend, dynamic=options.dynamic, fullgraph=options.fullgraph)
        return self._compiled

    def _blocks_to_compile(self, module: torch.nn.Module) -> list:
        """The regions to compile by blocks, or [] to compile the whole model (with the reason logged
        when blocks were asked for or auto had to choose whole)."""
        options = self.plan.compile
        if options.compile_unit == "whole":
            return []
        if options.compile_unit == "auto" and options.shapes.pin:
            log.info("Kiln: %s compiles whole: pinned shapes are compiled ahead, with the first compile, as "
                     "static variants of the whole model's graph (by blocks they would wait for the first call "
                     "at each; compile_unit: blocks does that)", label_of(module))
            return []
        regions = regions_of(module)
        if options.compile_unit == "blocks" and regions:
            if options.shapes.pin:
                log.info("Kiln: %s compiles by blocks: each pinned shape gets static variants of the regions' "
                         "graphs when the model first runs at it, not ahead", label_of(module))
            return regions
        if has_repeated_blocks(regions):
            return regions
        why = "it has no blocks" if not regions else "no two of its blocks are alike"
        if options.compile_unit == "blocks":
            note = f"compile_unit blocks: {why}; it compiles whole"
            log.warning("Kiln: %s %s", label_of(module), note)
            self.stats.warnings.append(note)
        else:
            log.info("Kiln: %s compiles whole: %s", label_of(module), why)
        return []

    def _fall_back(self, reason: str, exc: Optional[BaseException] = None) -> None:
        self.stats.fallback = reason
        log.error("Kiln: %s -- %s runs eagerly from now on", reason, label_of(self.original),
                  exc_info=exc)


def _device_of(module: torch.nn.Module) -> str:
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"
