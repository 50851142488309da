"""A model compiled by blocks: one compiled entry per region, and the guard around every block call.

`RegionalCompile` holds, for one KilnModel, a `CompiledRegion` per distinct block (compiler/blocks.py).
Each has an entry function with a code object of its own (TorchDynamo keeps graphs and counts its
recompile limit per code object, so every region of every model has its own budget) and a
KilnBackend of its own, sharing the model's stats, cache and CUDA graph budget. While the model runs
(`routed()`), a call of any block goes to its region's compiled entry with the block itself as an
argument: its parameters are graph inputs, so the blocks of one region share the graphs and each
reads its own live weights (LoRA and in-place patches show up without a recompile).

Per region, as the whole model has it: the first call compiles (with the region named in the
progress, the log and the stats); a failed compile sends that region, and only it, to eager with the
reason logged and kept (`stats.region_fallbacks`); a cancel from the progress callback propagates
untouched and keeps nothing of the half-done compile.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import compat
from .backend import KilnBackend
from .blocks import Region
from .cache import GraphCache
from .cuda_graph_budget import CudaGraphBudget
from .options import CompileOptions
from .passes import Progress
from .shapes import contiguous_inputs, mark_block_inputs_dynamic, text_lengths
from .stats import KilnStats

log = logging.getLogger("kiln")


class CompiledRegion:
    """One region's compiled entry and the guard every call of one of its blocks goes through."""

    def __init__(self, region: Region, options: CompileOptions, stats: KilnStats, cache: Optional[GraphCache],
                 label: str, budget: Optional[CudaGraphBudget], progress: "RegionProgress"):
        self.region = region
        self.stats = stats
        self.label = label
        self.fallback: Optional[str] = None
        # a code object of its own per region (see compiler/model.py's `_entry_function` for why)
        entry = compat.module_body_entry(f"kiln_{label}_{region.name}".replace(".", "_").replace("#", "_"))
        self.code = entry.__code__
        self.backend = KilnBackend(options, stats, code=self.code, cache=cache, label=f"{label} {region.name}",
                                   region=region.name, cuda_graph_budget=budget)
        self.backend.progress = progress.for_region(region)
        # auto: the model call's batch and resolution are marked dynamic on the block's inputs
        # (RegionalCompile.routed), as the whole model's graph has them
        self.marks = options.dynamic is None
        self.compiled = torch.compile(entry, backend=self.backend, dynamic=options.dynamic, fullgraph=options.fullgraph)
        self.call_shape: tuple[int, frozenset] = (0, frozenset())  # the model call's batch and text lengths

    def __call__(self, block: torch.nn.Module, *args, **kwargs):
        if self.fallback is not None:
            return compat.call_module_body(block, *args, **kwargs)
        args, kwargs = contiguous_inputs(args, kwargs)
        if self.marks:
            mark_block_inputs_dynamic(args, kwargs, *self.call_shape)
        backend = self.backend
        backend.before_call()
        try:
            out = self.compiled(block, *args, **kwargs)
        except compat.compile_failure_types() as exc:
            if backend.interrupt is not None:  # cancelled, not failed: nothing was installed
                raise backend.interrupt from None
            self._fall_back(f"compile failed: {compat.describe_compile_failure(exc)}", exc)
            return compat.call_module_body(block, *args, **kwargs)
        else:
            backend.after_call()
            return out
        finally:
            backend.end_call()
            compat.forget_code(self.code)

    def _fall_back(self, reason: str, exc: BaseException) -> None:
        self.fallback = reason
        self.stats.region_fallbacks[self.region.name] = reason
        message = (f"region {self.region.name} ({len(self.region.members)} block(s): {self.region.members[0]}...) "
                   f"{reason}; those blocks run eagerly from now on, the other regions stay compiled")
        self.stats.warnings.append(message)
        log.error("Kiln: %s: %s", self.label, message, exc_info=exc)


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


class RegionalCompile:
    """Every region of one model, compiled lazily, and the routing of its blocks' calls."""

    def __init__(self, regions: list[tuple[Region, list[torch.nn.Module]]], options: CompileOptions, stats: KilnStats,
                 cache: Optional[GraphCache], label: str):
        budget = CudaGraphBudget(options.shapes.max_cuda_graphs) if options.cuda_graphs else None
        self.progress = RegionProgress(len(regions))
        self.regions = [CompiledRegion(region, options, stats, cache, label, budget, self.progress)
                        for region, _ in regions]
        self._routes = {}
        for compiled, (_, blocks) in zip(self.regions, regions):
            for block in blocks:
                self._routes[block] = _route(compiled, block)
        stats.regions = [region for region, _ in regions]

    def routed(self, progress: Optional[Progress], args, kwargs):
        """A context for one call of the model with `args`, `kwargs`: its blocks run through their regions."""
        self.progress.callback = progress
        shape = (_batch(args, kwargs), text_lengths(args, kwargs))
        for region in self.regions:
            region.call_shape = shape
        return compat.calls_routed(self._routes)


def _batch(args, kwargs) -> int:
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 0


def _route(compiled: CompiledRegion, block: torch.nn.Module):
    def call(*args, **kwargs):
        return compiled(block, *args, **kwargs)
    return call
