"""Kiln's rewrite passes, in the order they run, and the pass manager.

Each pass is one file; this table is the only place that lists them. Order matters:
attention is canonicalised first (it removes casts and matmuls the others never need to see),
its backend chosen next (on CUDA), the kernel fusions next, the layout change last (it wraps whatever convs remain).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from .base import GraphPass, PassContext, PassResult, hash_files
from .canonicalize_attention import CanonicalizeAttention
from .channels_last_convs import ChannelsLastConvs
from .choose_attention_backend import ChooseAttentionBackend
from .fuse_adaln_modulation import FuseAdalnModulation
from .fuse_geglu import FuseGeglu
from .fuse_group_norm_silu import FuseGroupNormSilu

PASSES: tuple[GraphPass, ...] = (
    CanonicalizeAttention(),
    ChooseAttentionBackend(),
    FuseGeglu(),
    FuseGroupNormSilu(),
    FuseAdalnModulation(),
    ChannelsLastConvs(),
)
PASS_NAMES = tuple(p.name for p in PASSES)

Progress = Callable[[str, int, int], None]  # (what, done, total)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, switches: dict[str, str],
               progress: Optional[Progress] = None, total_steps: Optional[int] = None) -> list[PassResult]:
    """Run every pass not switched off, in order; return what each did. The graph is linted and
    recompiled once at the end."""
    results = []
    total = total_steps or len(PASSES)
    for i, graph_pass in enumerate(PASSES):
        switch = switches.get(graph_pass.name, "auto")
        result = PassResult(graph_pass.name)
        if switch != "off":
            start = time.perf_counter()
            graph_pass.apply(gm, dataclasses.replace(ctx, switch=switch), result)
            result.seconds = time.perf_counter() - start
        results.append(result)
        if progress is not None:
            progress(f"pass {graph_pass.name}", i + 1, total)
    gm.graph.lint()
    gm.recompile()
    return results


def passes_uuid() -> str:
    """Identity of the whole pass pipeline, for cache keys: every pass's uuid (its source, the shared
    helpers, its kernel) and this file (the order they run in)."""
    return hash_files([__file__]) + "-" + "-".join(p.uuid() for p in PASSES)


__all__ = ["PASSES", "PASS_NAMES", "GraphPass", "PassContext", "PassResult", "run_passes", "passes_uuid"]
