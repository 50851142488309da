"""Which of the region choice's shortcuts hold on a device, and which do not on CUDA.

The region choice (compiler/regional/region_choice.py) saves lowerings with two shortcuts that were
measured on a CPU, where the host does the work: a block class judged by its first regions
(`ClassVerdicts`), and a block whose graph has nothing for Inductor to fuse run as captured
(compiler/regional/fusible.py). On CUDA neither is taken (EVERY_REGION_MEASURED): every region,
ResNet and Down/Upsample blocks included, is lowered and measured by the GPU's own time
(compiler/regional/gpu_time.py): on a host-bound machine the host's wall clock and the class rule
keep eager blocks whose compiled code does less GPU work (docs/measurements/2026-11-27-gpu-h200.md);
Inductor's fusion of a convolution's neighbours (bias, norm, activation, the residual add, the layout
copies around it) is GPU work a step no longer does, which only a GPU clock sees.

The glue between blocks (compiler/regional/glue.py) is compiled as regions of its own by default only
on the devices of GLUE_COMPILED_BY_DEFAULT: there each of its regions is measured by the GPU's clock
and stays compiled only where it saves GPU time; on a CPU it runs eagerly, as before, unless asked for.
"""
from __future__ import annotations

EVERY_REGION_MEASURED = frozenset({"cuda"})  # devices where each region is measured, none judged by a shortcut
GLUE_COMPILED_BY_DEFAULT = frozenset({"cuda"})  # devices where glue_regions auto compiles the glue between blocks


def judged_by_class(device: str) -> bool:
    """Whether a region on `device` may be decided eager by the verdict of its block class."""
    return device not in EVERY_REGION_MEASURED


def runs_as_captured_when_idle(device: str) -> bool:
    """Whether a graph with nothing for Inductor to fuse runs as captured on `device` (else it is
    lowered, and its region measured like any other)."""
    return device not in EVERY_REGION_MEASURED


def compiles_glue_by_default(device: str) -> bool:
    """Whether `glue_regions: auto` compiles the glue between blocks as regions of its own on `device`."""
    return device in GLUE_COMPILED_BY_DEFAULT
