"""What the compiled units of one model share, and what one unit is, as the backend sees them.

A model compiles as one unit (the whole model) or as many (one per block region: compiler/regional).
Every unit of a model shares its `ModelContext`: the options, the stats, Kiln's cache, the model's
label and its CUDA-graph budget. A `CompileUnit` is what the backend needs of one unit: the code
object TorchDynamo compiles, the name its records carry, and the unit's answers to the two questions
where a whole model and a block region differ (is a graph run as captured; does a dynamic graph go
through the shape manager).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import CodeType
from typing import Callable, Optional

import torch

from ..cache import GraphCache
from ..options.compile_options import CompileOptions
from ..shapes.cuda_graph_budget import CudaGraphBudget
from ..shapes.shape_manager import CallShape
from ..stats import KilnStats


@dataclass
class ModelContext:
    """One model's compile: its options, stats, cache (None: not cached), label (the model's class
    name, in logs and cache listings) and, with `cuda_graphs` on a CUDA device, its CUDA-graph budget
    (made with the first graph that needs it, shared by every unit of the model)."""

    options: CompileOptions
    stats: KilnStats
    cache: Optional[GraphCache] = None
    label: str = "model"
    cuda_graph_budget: Optional[CudaGraphBudget] = None

    def budget_for(self, device: str) -> Optional[CudaGraphBudget]:
        """The model's CUDA-graph budget where CUDA graphs apply (`cuda_graphs` on, a CUDA device), else None."""
        if not (self.options.cuda_graphs and device == "cuda"):
            return None
        if self.cuda_graph_budget is None:
            self.cuda_graph_budget = CudaGraphBudget(self.options.shapes.max_cuda_graphs)
        return self.cuda_graph_budget


# asked before a graph's passes: why to run the graph as TorchDynamo captured it ('' to lower it). The
# flag says whether the graph is the unit's first and holds the unit's whole code (no graph break)
AsCaptured = Callable[[torch.fx.GraphModule, str, bool], str]


@dataclass(frozen=True)
class CompileUnit:
    """One compiled entry of a model.

    code: the code object TorchDynamo compiles (the unit's own: its graphs and recompile limit are its own).
    name: what records and logs call it ("" for the whole model, a region's name for a block region).
    call_shape: the model call a unit's graphs run in, which the shape policy decides a unit's static
        variants by (a block region's; None: the unit's own inputs are the model's).
    as_captured: the unit's rule for running a graph as captured (None: every graph is lowered).
    """

    code: Optional[CodeType] = None
    name: str = ""
    call_shape: Optional[Callable[[], Optional[CallShape]]] = None
    as_captured: Optional[AsCaptured] = None

    @property
    def is_whole_model(self) -> bool:
        """The whole model: every dynamic graph records its shape signatures (the shape manager), and
        pinned shapes are compiled ahead with its first graph."""
        return not self.name

    def describe(self) -> str:
        return f"region {self.name}" if self.name else "model"
