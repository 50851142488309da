"""The shape manager: one captured graph, many shape signatures.

Kiln's backend hands TorchDynamo a `ShapeDispatcher` instead of the lowered graph whenever the
graph has symbolic sizes. On every call the dispatcher reads the signature (the exact sizes and
strides of the graph's activations) and runs the variant for it:

- compiled:    the lowering TorchDynamo's capture produced (the first signature of a graph);
- reused:      that same lowering, for a new signature: its sizes are symbolic, so every
               expand/view/reshape/interpolate size is recomputed from the new inputs (nothing
               keeps the shape it was traced at) and nothing is compiled;
- specialised: the captured graph lowered again with every size fixed (static kernels). No
               TorchDynamo capture and no passes: only the lowering. The ShapePolicy says which
               signatures (pinned shapes, resolution buckets) get one; at most `max_variants` are
               kept, the least recently used evicted.

A block region's graph (compiled by blocks) is dispatched the same way, but its inputs are a block's,
sized by where the block sits in the model: the policy decides its variants by the model call's
batch and latent (`CallShape`, given by the regions' routing), and a pinned shape is specialised when
the model first runs at it, not ahead (what a block is given at a shape not yet sampled is not known).

A static variant never runs a signature other than its own: the dispatcher keys on exact sizes
and strides, and Inductor's static code asserts them besides. With `cuda_graphs` on, every call
runs under the model's CudaGraphBudget (compiler/shapes/cuda_graph_budget.py), which bounds how many
signatures record a CUDA graph.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..torch_compat import dynamo, fx_graphs
from .cuda_graph_budget import CudaGraphBudget
from ..options.shape_policy import LATENT_FACTOR, PinnedShape, ShapePolicy, ShapePolicyError, pixels_problem
from .inputs import activation_indices, shapes_key
from ..stats import KilnStats, VariantRecord

log = logging.getLogger("kiln")

REUSED_KEPT = 256  # signatures remembered per graph for reused variants (bookkeeping only, no code)


@dataclass
class _Entry:
    run: Callable
    record: VariantRecord
    shape: Optional["CallShape"] = None  # a block region's graph: the model call the variant was made in


@dataclass(frozen=True)
class CallShape:
    """The model call a block region's graph runs in: the batch and latent (height, width) the shape
    policy decides the region's variants by, and the batch of the model's first call."""
    batch: int
    latent: tuple[int, int]
    first_batch: int

    def describe(self) -> str:
        height, width = self.latent
        return f"the model at batch {self.batch}, latent {height}x{width} ({width * LATENT_FACTOR}x{height * LATENT_FACTOR} px)"


class ShapeDispatcher:
    """Runs one captured graph for every signature its guards admit; see the module docstring.

    `gm` is the captured graph after Kiln's passes, not yet lowered when `lower_static` is given;
    `lower_static(gm, args)` lowers a graph for the concrete `args` (None: never specialise).
    `call_shape()`: a block region's graph, the model call it runs in (None outside one: nothing is
    specialised then).
    """

    def __init__(self, gm: torch.fx.GraphModule, generic: Callable, lower_static: Optional[Callable],
                 policy: ShapePolicy, stats: KilnStats, graph_index: int, compile_seconds: float, progress=None,
                 compile_pinned: bool = False, cuda_graphs: Optional[CudaGraphBudget] = None,
                 call_shape: Optional[Callable[[], Optional[CallShape]]] = None):
        self._inputs = activation_indices(gm)
        self._fakes = [fx_graphs.fake_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = [i for i in self._inputs if isinstance(self._fakes[i], torch.Tensor)]
        # the latent: the first 4-D (or 5-D video) activation; its dims are batch, channels, (frames,) H, W
        self._latent = next((i for i in tensors if self._fakes[i].dim() in (4, 5)), None)
        self._gm = gm
        self._generic = generic
        self._lower_static = lower_static
        self.policy = policy
        self.stats = stats
        self.graph_index = graph_index
        self._compile_seconds = compile_seconds
        self._progress = progress
        # only graphs of the model's first call (later ones are other branches): pinned shapes are
        # compiled ahead, and the first signature itself is specialised if the policy wants it
        self._compile_pinned_ahead = compile_pinned
        self._entries: "OrderedDict[tuple, _Entry]" = OrderedDict()
        self._first_batch: Optional[int] = None
        self._cuda_graphs = cuda_graphs
        self._call_shape = call_shape
        self._added: list[VariantRecord] = []  # the records the signature being added made so far

    # ---- signatures --------------------------------------------------------------------------

    def _key(self, args) -> tuple:
        return shapes_key(args, self._inputs)

    def _latent_size(self, args) -> tuple[Optional[int], Optional[tuple[int, int]]]:
        if self._latent is None:
            return None, None
        shape = args[self._latent].shape
        return shape[0], (shape[-2], shape[-1])

    def describe(self, args) -> str:
        """'batch 2, latent 64x64 (512x512 px), context 77, float16 cuda'; a block region's graph:
        its inputs' shapes and the model call's ('inputs 2x320x32x32 2x1280, float16 cuda, in the
        model at batch 2, latent 64x64 (512x512 px)')."""
        tensors = [args[i] for i in self._inputs if isinstance(args[i], torch.Tensor)]
        inputs = "inputs " + " ".join("x".join(map(str, t.shape)) for t in tensors)
        kind = [f"{str(tensors[0].dtype).replace('torch.', '')} {tensors[0].device.type}"] if tensors else []
        if self._call_shape is not None:
            shape = self._call_shape()
            return ", ".join([inputs, *kind]) + (f", in {shape.describe()}" if shape is not None else "")
        batch, hw = self._latent_size(args)
        if hw is None:
            return ", ".join([inputs, *kind])
        parts = [f"batch {batch}", f"latent {hw[0]}x{hw[1]} ({hw[1] * LATENT_FACTOR}x{hw[0] * LATENT_FACTOR} px)"]
        context = next((t for t in tensors if t.dim() == 3 and t.is_floating_point()), None)
        if context is not None:
            parts.append(f"context {context.shape[1]}")
        return ", ".join(parts + kind)

    # ---- dispatch ----------------------------------------------------------------------------

    def __call__(self, *args):
        key = self._key(args)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_signature_or_nothing(key, args)
        else:
            self._entries.move_to_end(key)
        entry.record.calls += 1
        if self._cuda_graphs is not None:
            return self._cuda_graphs.run(entry.record, entry.run, args)
        return entry.run(*args)

    def _new_signature_or_nothing(self, key: tuple, args) -> _Entry:
        """A new signature's entry; if it is interrupted (the progress callback raised: a cancel
        during the pinned shapes' compile), nothing of it stays, so the next call starts it again.
        Its records are taken back by identity: another region's graph may add its own meanwhile, on
        the model's lowering thread."""
        entries, self._added = set(self._entries), []
        try:
            return self._new_signature(key, args)
        except BaseException:
            for k in [k for k in self._entries if k not in entries]:
                del self._entries[k]
            for record in self._added:
                del self.stats.variants[next(i for i, r in enumerate(self.stats.variants) if r is record)]
            raise

    def _new_signature(self, key: tuple, args) -> _Entry:
        if self._call_shape is not None:
            return self._new_region_signature(key, args)
        batch, hw = self._latent_size(args)
        if not self._entries:  # the signature TorchDynamo captured the graph at
            self._first_batch = batch
            entry = self._add(key, self._generic, "compiled", args, self._compile_seconds)
            if self._compile_pinned_ahead:
                self._compile_pinned(args)
                if self._lower_static is not None and self.policy.wants_specialised(hw, batch, batch):
                    self._specialise_first(key, args, "pinned" if self._is_pinned(hw, batch) else "resolution bucket")
            return entry
        if self._lower_static is not None and self.policy.wants_specialised(hw, batch, self._first_batch):
            return self._specialise(key, args, "resolution bucket" if not self._is_pinned(hw, batch) else "pinned")
        return self._add(key, self._generic, "reused", args, 0.0)

    def _new_region_signature(self, key: tuple, args) -> _Entry:
        """A block region's graph: the first signature runs the lowering it was captured for, every
        other the same lowering ("reused"), unless it is sampled while the model runs at a pinned or
        bucket shape: then it gets a static variant (the first signature from its next block call on).
        A signature is decided by the model call it is first sampled in: the same block inputs at
        another model shape (a DiT's tokens at 128x64 and 64x128) run what that decided."""
        first, shape = not self._entries, self._call_shape()
        wanted = (shape is not None and self._lower_static is not None
                  and self.policy.wants_specialised(shape.latent, shape.batch, shape.first_batch))
        why = "pinned" if wanted and self._is_pinned(shape.latent, shape.batch, shape.first_batch) else "resolution bucket"
        if wanted and not first:
            return self._specialise(key, args, why)
        entry = self._add(key, self._generic, "compiled" if first else "reused", args,
                          self._compile_seconds if first else 0.0)
        if wanted:
            self._specialise_first(key, args, why)
        return entry

    def _specialise_first(self, key, args, why: str) -> None:
        """The first signature is pinned or a bucket: static kernels for it too (this call still runs
        the dynamic lowering it was captured for; the next ones run the static variant)."""
        if self._progress is not None:
            self._progress(f"specialising the first shape ({why})", 1, 1)
        self._specialise(key, args, why)

    def _is_pinned(self, hw, batch, first_batch: Optional[int] = None) -> bool:
        first_batch = self._first_batch if first_batch is None else first_batch
        return any(p.latent == hw and (p.batch or first_batch) == batch for p in self.policy.pin)

    def _add(self, key, run, how: str, args, seconds: float, note: str = "") -> _Entry:
        record = VariantRecord(graph=self.graph_index, signature=self.describe(args), how=how, seconds=seconds, note=note)
        self.stats.variants.append(record)
        self._added.append(record)
        entry = self._entries[key] = _Entry(run, record, self._call_shape() if self._call_shape is not None else None)
        if how != "compiled":
            log.info("Kiln variant: %s", record.line())
        self._evict()
        return entry

    def _specialise(self, key, args, why: str) -> _Entry:
        start = time.perf_counter()
        try:
            run = self._lower_static(fx_graphs.copy_graph_module(self._gm), list(args))
        except Exception as exc:  # noqa: BLE001  the generic graph still serves this signature; say so loudly
            reason = f"specialising {self.describe(args)} failed ({dynamo.describe_compile_failure(exc)}); it runs on the dynamic graph"
            log.error("Kiln: %s", reason, exc_info=exc)
            self.stats.warnings.append(reason)
            return self._add(key, self._generic, "reused", args, time.perf_counter() - start, note="specialisation failed")
        return self._add(key, run, "specialised", args, time.perf_counter() - start, note=why)

    def _evict(self) -> None:
        """The least recently used specialised variants past `max_variants`; a block region's graph keeps
        those of the model call under way (its blocks at several depths need one each in every call at
        that shape, whatever the bound)."""
        specialised = [k for k, e in self._entries.items() if e.record.how == "specialised"]
        now = self._call_shape() if self._call_shape is not None else None
        evictable = [k for k in specialised if now is None or self._entries[k].shape != now]
        for k in evictable[: max(len(specialised) - self.policy.max_variants, 0)]:
            record = self._entries.pop(k).record
            record.evicted = True
            self.stats.evictions += 1
            log.info("Kiln: evicted the least recently used specialised variant (%s; max_variants=%d)",
                     record.signature, self.policy.max_variants)
        reused = [k for k, e in self._entries.items() if e.record.how == "reused"]
        for k in reused[: max(len(reused) - REUSED_KEPT, 0)]:
            del self._entries[k]

    # ---- pinned shapes: compiled ahead, with the first compile --------------------------------

    def _compile_pinned(self, args) -> None:
        if self._lower_static is None or self._latent is None or not self.policy.pin:
            return
        pins = list(self.policy.pin)
        for done, pin in enumerate(pins, 1):
            try:
                pinned_args = self._args_for(pin, args)
            except Exception as exc:  # noqa: BLE001  e.g. out of memory: this pin's variant failed, as _specialise says
                self._pin_failed(pin, exc)
                continue
            if pinned_args is None:  # e.g. a graph TorchDynamo specialised to batch 1: not this pin's graph
                continue
            key = self._key(pinned_args)
            if key in self._entries:
                continue
            if self._progress is not None:
                self._progress(f"specialising pinned shape {pin}", done, len(pins))
            self._specialise(key, pinned_args, "pinned, compiled ahead")

    def _pin_failed(self, pin: PinnedShape, exc: Exception) -> None:
        """The inputs of a pinned shape could not be built: logged and warned, nothing compiled ahead
        (a call at that shape later is served, and specialised, as any other)."""
        problem = str(exc) if isinstance(exc, ShapePolicyError) else dynamo.describe_compile_failure(exc)
        reason = (f"pinned shape {pin.width}x{pin.height} at batch {pin.batch or self._first_batch} is not compiled ahead: "
                  f"building its inputs failed ({problem})")
        log.error("Kiln: %s", reason, exc_info=None if isinstance(exc, ShapePolicyError) else exc)
        self.stats.warnings.append(reason)

    def _args_for(self, pin: PinnedShape, args) -> Optional[list]:
        """Graph inputs of the pinned shape: `args` with every symbolic size rebound (random activations).
        A pin without a batch is held to MAX_PIN_PIXELS at the first call's batch (ShapePolicyError)."""
        problem = pixels_problem(pin.width, pin.height, pin.batch or self._first_batch)
        if problem:
            raise ShapePolicyError(f"shapes.pin: {pin}: {problem}")
        binding: dict = {}
        for i in self._inputs:
            fake, real = self._fakes[i], args[i]
            if isinstance(fake, torch.Tensor):
                for size, value in zip(fake.shape, real.shape):
                    expr = fx_graphs.size_expr(size)
                    if getattr(expr, "is_Symbol", False):
                        binding[expr] = value
            elif isinstance(fake, torch.SymInt) and getattr(fx_graphs.size_expr(fake), "is_Symbol", False):
                binding[fx_graphs.size_expr(fake)] = real
        latent = [fx_graphs.size_expr(s) for s in self._fakes[self._latent].shape]
        wanted = {0: pin.batch or self._first_batch, len(latent) - 2: pin.latent[0], len(latent) - 1: pin.latent[1]}
        for dim, value in wanted.items():
            if not getattr(latent[dim], "is_Symbol", False):
                if latent[dim] != value:
                    return None
                continue
            binding[latent[dim]] = value

        def size(s) -> int:
            expr = fx_graphs.size_expr(s)
            return int(expr) if isinstance(expr, int) else int(expr.subs(binding))

        new = list(args)
        for i in self._inputs:
            fake, real = self._fakes[i], args[i]
            if isinstance(fake, torch.Tensor):
                shape = [size(s) for s in fake.shape]
                make = torch.randn if real.is_floating_point() else torch.zeros
                new[i] = make(shape, dtype=real.dtype, device=real.device)
            elif isinstance(fake, torch.SymInt):
                new[i] = size(fake)
        return new
