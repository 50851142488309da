"""What a compiled model did: every graph compiled, why, which passes fired, how long it took."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..events import CompileEvent


@dataclass
class GraphCompile:
    """One call of Kiln's backend: TorchDynamo handed it one FX graph."""

    index: int
    reason: str                     # "first compile", or TorchDynamo's guard failure for a recompile
    lowering: str                   # "fx" (fast), "inductor", "inductor max-autotune", ...
    input_shapes: list[list[int]]   # shapes of the non-parameter tensor inputs
    nodes: int
    rewrites: dict[str, int]        # pass name -> places rewritten
    skipped: dict[str, list[str]]   # pass name -> reasons a match was left alone
    seconds: float                  # passes + lowering (TorchDynamo's tracing is not included)
    dynamic: bool = False           # the graph has symbolic shapes
    capture_seconds: float = 0.0    # TorchDynamo's capture before Kiln's backend got the graph
    graph_breaks: list[str] = field(default_factory=list)  # breaks hit capturing it ('where: what'); it ends at the last
    region: str = ""                # the block region it compiles ("ResnetBlock2D#2"); "" for the whole model
    notes: dict[str, list[str]] = field(default_factory=dict)  # pass name -> what it chose (the attention backend)

    def event(self) -> CompileEvent:
        """This compile as the nodes show it and `kiln queue` reads it (events.py)."""
        return CompileEvent(self.index, round(self.capture_seconds + self.seconds, 1), self.lowering, self.dynamic,
                            self.reason.partition("\n")[0], self.region)

    def line(self) -> str:
        fired = ", ".join(f"{k} x{v}" for k, v in self.rewrites.items() if v) or "none"
        where = f" (region {self.region})" if self.region else ""
        return (f"graph {self.index}{where}: {self.nodes} nodes, inputs {self.input_shapes}{' (dynamic)' if self.dynamic else ''}, "
                f"captured in {self.capture_seconds:.1f}s, lowered by {self.lowering} in {self.seconds:.1f}s; passes fired: {fired}; reason: {self.reason}"
                + (f"; ends at graph break {self.graph_breaks[-1]}" if self.graph_breaks else ""))


@dataclass
class VariantRecord:
    """One shape signature a compiled graph has run (see compiler/shapes/shape_manager.py)."""

    graph: int                      # the GraphCompile it belongs to
    signature: str                  # "batch 2, latent 64x64 (512x512 px), context 77, float32 cpu"
    how: str                        # "compiled" | "reused" | "specialised"
    seconds: float                  # what obtaining it cost (0 for reused)
    calls: int = 0
    evicted: bool = False           # dropped by the LRU bound (shapes.max_variants)
    note: str = ""                  # why it was specialised ("pinned", "resolution bucket"), or what failed
    cuda_graph: str = ""            # with cuda_graphs on: "recorded" or why not (compiler/shapes/cuda_graph_budget.py)

    def line(self) -> str:
        extra = f", {self.note}" if self.note else ""
        graph = f", CUDA graph: {self.cuda_graph}" if self.cuda_graph else ""
        return (f"graph {self.graph} {self.how} for {self.signature} in {self.seconds:.1f}s{extra}{graph}"
                f"{' (evicted)' if self.evicted else ''}")


# why a region of a model compiled by blocks runs eagerly by choice, as the node's line counts them
EAGER_KINDS = {
    "nothing_to_fuse": "nothing to fuse",                                # compiler/regional/fusible.py
    "measured": "measured no faster compiled",                           # compiler/regional/region_choice.py
    "class": "not compiled after their class's first",                   # region_choice.ClassVerdicts
    "convolutions": "convolution blocks on a CPU",                       # cpu.eager_before_capture (compiler/cpu)
    "fidelity": "differed from eager on their first call",               # compiler/graphs/fidelity_guard.py
    "unmeasured_glue": "glue not measured against eager",                 # compiler/regional/glue.py
}


@dataclass
class KilnStats:
    options: dict
    compiles: list[GraphCompile] = field(default_factory=list)
    fallback: Optional[str] = None  # set when the model runs eagerly instead, with the reason
    eager_calls: int = 0            # calls TorchDynamo ran without a compiled graph (e.g. recompile limit)
    eager_call_reason: Optional[str] = None  # why the first of them ran eagerly
    warnings: list[str] = field(default_factory=list)
    variants: list[VariantRecord] = field(default_factory=list)
    evictions: int = 0              # specialised variants dropped by the LRU bound
    cache: list = field(default_factory=list)  # CacheEvents (compiler/cache): hit or miss per lowering, and why
    regions: list = field(default_factory=list)  # compiled by blocks: the Regions (compiler/regional/blocks.py); [] for whole
    region_fallbacks: dict = field(default_factory=dict)  # region name -> why its compile failed (its blocks run eagerly)
    regions_eager: dict = field(default_factory=dict)  # region name -> why it runs eagerly by choice
    eager_kinds: dict = field(default_factory=dict)  # region name -> which kind of choice (EAGER_KINDS)
    region_timings: dict = field(default_factory=dict)  # region name -> RegionTiming: its first call, compiled and eager
    memory: Any = None  # the host's MemoryVerdict in force (compiler/memory_budget.py): streamed blocks kept eager
    cuda_graphs: Any = None  # cuda_graphs auto on CUDA: the model's WholeCallGraphs (compiler/graphs), its report and guard

    def warn_once(self, note: str) -> bool:
        """Keep `note` among the warnings unless it is there already; True if it is new (then say it)."""
        if note in self.warnings:
            return False
        self.warnings.append(note)
        return True

    @property
    def compile_count(self) -> int:
        return len(self.compiles)

    @property
    def graph_breaks(self) -> dict[str, int]:
        """Where TorchDynamo broke the model's graph and why ('file:line in function: what'), with how
        many captured graphs hit each: code there runs in Python between compiled graphs."""
        return dict(Counter(b for c in self.compiles for b in c.graph_breaks))

    @property
    def recompiles(self) -> list[GraphCompile]:
        """Graphs compiled because a guard failed (shape, dtype, grad mode...), with the reason."""
        return [c for c in self.compiles if c.reason.startswith("recompile")]

    def units_line(self) -> str:
        """'44 blocks in 21 regions (one compiled code each), 21 graph(s), 5 region(s) eager by choice
        (nothing to fuse, or measured no faster compiled)'; "" for a whole-model compile."""
        if not self.regions:
            return ""
        blocks = sum(len(region.members) for region in self.regions if not region.glue)
        glue = sum(region.glue for region in self.regions)
        line = (f"{blocks} blocks in {len(self.regions) - glue} regions"
                + (f" and the glue in {glue} region(s)" if glue else "")
                + f" (one compiled code each), {self.compile_count} graph(s)")
        if self.regions_eager:
            line += f", {len(self.regions_eager)} region(s) eager by choice ({self._eager_kinds()})"
            if len(self.regions_eager) == len(self.regions):
                line += "; no region is faster compiled here, so the model runs as it does eagerly"
        return line

    def keep_eager(self, region: str, kind: str, why: str) -> None:
        """Region `region` runs eagerly by choice: `kind` (an EAGER_KINDS key) and why, in words."""
        if kind not in EAGER_KINDS:
            raise ValueError(f"unknown kind of eager region {kind!r}; one of {', '.join(EAGER_KINDS)}")
        self.regions_eager[region] = why
        self.eager_kinds[region] = kind

    def _eager_kinds(self) -> str:
        """'5 nothing to fuse, 2 measured no faster compiled, 9 not compiled after their class's first'."""
        counts = Counter(self.eager_kinds.values())
        return ", ".join(f"{counts[kind]} {words}" for kind, words in EAGER_KINDS.items() if counts[kind])

    def variant_counts(self) -> dict[str, int]:
        """How each shape signature was served: {"compiled": n, "reused": n, "specialised": n}."""
        return dict(Counter(v.how for v in self.variants))

    @property
    def pass_counts(self) -> dict[str, int]:
        total: Counter = Counter()
        for c in self.compiles:
            total.update(c.rewrites)
        return dict(total)

    def summary(self) -> str:
        lines = [f"Kiln {self.options.get('mode')}: {self.compile_count} graph(s) compiled, {len(self.recompiles)} recompile(s)"]
        if self.regions:
            lines.append(f"  by blocks: {self.units_line()}")
            lines += ["    " + region.line() for region in self.regions]
        if self.fallback:
            lines.append(f"RUNNING EAGER: {self.fallback}")
        lines += [f"REGION {name} RUNS EAGER: {why}" for name, why in self.region_fallbacks.items()]
        lines += [f"  region {name} runs eagerly by choice: {why}" for name, why in self.regions_eager.items()]
        lines += [f"  region {name} stays compiled: {timing.line()}" for name, timing in self.region_timings.items()
                  if name not in self.regions_eager]
        if self.eager_calls:
            lines.append(f"{self.eager_calls} call(s) ran eagerly: {self.eager_call_reason}")
        if self.memory is not None and self.memory.why:
            lines.append(f"  memory: {self.memory.why}")
        lines += [f"  graph break at {where} ({n} graph(s))" for where, n in self.graph_breaks.items()]
        lines += ["  " + c.line() for c in self.compiles]
        if self.variants:
            counts = ", ".join(f"{n} {how}" for how, n in self.variant_counts().items())
            graphs = sum(v.cuda_graph == "recorded" for v in self.variants)
            lines.append(f"  shape signatures: {counts}" + (f", {self.evictions} evicted" if self.evictions else "")
                         + (f", {graphs} CUDA graph(s) recorded" if any(v.cuda_graph for v in self.variants) else ""))
            lines += ["    " + v.line() + f", {v.calls} call(s)" for v in self.variants]
        lines += ["  " + event.line() for event in self.cache]
        if self.cuda_graphs is not None:
            lines += ["  " + self.cuda_graphs.report.line(), "  " + self.cuda_graphs.guard.line()]
            lines += [f"    {calls} call(s) {why}" for why, calls in self.cuda_graphs.report.fallbacks.items()]
        skipped = {name: reasons for c in self.compiles for name, reasons in c.skipped.items() if reasons}
        for name, reasons in skipped.items():
            lines.append(f"  {name} skipped {len(reasons)}x: {sorted(set(reasons))[0]}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"options": self.options, "fallback": self.fallback, "eager_calls": self.eager_calls,
                "eager_call_reason": self.eager_call_reason,
                "warnings": self.warnings, "compiles": [asdict(c) for c in self.compiles],
                "pass_counts": self.pass_counts, "recompiles": len(self.recompiles), "graph_breaks": self.graph_breaks,
                "variants": [asdict(v) for v in self.variants], "evictions": self.evictions,
                "cache": [asdict(event) for event in self.cache],
                "regions": [asdict(region) for region in self.regions], "region_fallbacks": self.region_fallbacks,
                "regions_eager": self.regions_eager, "eager_kinds": self.eager_kinds,
                "memory": None if self.memory is None else asdict(self.memory),
                "region_timings": {name: asdict(timing) for name, timing in self.region_timings.items()},
                "cuda_graphs": None if self.cuda_graphs is None else {**asdict(self.cuda_graphs.report),
                                                                      "guard": self.cuda_graphs.guard.line()}}
