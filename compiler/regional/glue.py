"""The glue between a model's blocks, compiled as regions of its own (`glue_regions`, choices.GLUE_REGIONS).

By blocks (compiler/regional/blocks.py) what is not in a block runs as the model's own code, eagerly: the
time embedding, conv_in, the final norm and conv_out of a UNet; the embedders, the rotary position
embedding and the final norm of a DiT. On CUDA their kernels are GPU time a step spends outside every
region, so they may be compiled too, each module as a region of its own, through the same machinery as
a block region (compiler/regional/regional_compile.py): routed while the model runs, measured against
eager, kept eager with the reason where it is not faster, its choice and its graphs kept in Kiln's cache,
a failed compile sending that region alone to eager.

**Which modules are glue**, by structure alone, as blocks are found (`find_glue`): walking down from the
model, a module outside every block that holds no block, and is the outermost such module:

- the model's own code (TimestepEmbedding, Timesteps, AdaLayerNormContinuous, FluxPosEmbed), or a
  container of layers that is called (ComfyUI's `time_embed` and `out` Sequentials): one region each,
  identical ones sharing it (their signature, as blocks' regions);
- not a lone torch.nn layer (`conv_in`, `conv_out`, `x_embedder`, a GroupNorm called by itself): its
  graph is one op, which Inductor has nothing to fuse with (compiler/regional/fusible.py MIN_FUSIBLE_OPS:
  its neighbours run in the model's forward, outside the graph);
- a ModuleList or ModuleDict holding no block is looked into (it is never called itself); a module that
  holds blocks (a UNet's down_blocks[i]) is looked into, and its own forward stays eager.

What stays eager whatever the option: the model's forward itself and the forwards of the modules that
hold blocks, with the loops, the concatenations of skip connections and the lone layers they call. A
concatenation is one copy, and fusing it needs the block that reads it in the same graph.

**When** (`glue_regions`): `auto` compiles the glue on the devices of gpu_choice.GLUE_COMPILED_BY_DEFAULT
(CUDA), and there only where every region's choice is measured (`measure_regions`, and
regional_compile.may_stay_eager: not with autotuning or `cuda_graphs: on`), so a glue region stays
compiled only where it saves GPU time; one whose first call is not measured (hooks, patches, several
graphs: CompiledRegion._not_measured) runs eagerly, where a block region would stay compiled. Elsewhere
the glue is not even looked for: on a CPU the model compiles, runs and says what it did as before. `on`
compiles it on every device (each region still measured where measuring is on, and kept compiled, as a
block region, where it cannot be), `off` never.
"""
from __future__ import annotations

import logging

import torch

from ..options.compile_options import CompileOptions
from . import gpu_choice
from .blocks import GLUE_PREFIX, Region, grouped, is_layer
from .regional_compile import may_stay_eager

log = logging.getLogger("kiln")

_LOOKED_INTO = (torch.nn.ModuleList, torch.nn.ModuleDict)  # never called: their elements may be glue


def find_glue(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) for every glue module of `model` whose blocks are `blocks`, in model order (see the
    module docstring)."""
    block_set = set(blocks)
    holders = {m for m in model.modules() if m not in block_set and any(s in block_set for s in m.modules())}
    found: list[tuple[str, torch.nn.Module]] = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if child in block_set or (is_layer(child) and child not in holders):
                continue
            if child in holders or isinstance(child, _LOOKED_INTO):
                walk(child, f"{prefix}{name}.")
            else:
                found.append((f"{prefix}{name}", child))

    walk(model, "")
    return found


def why_glue_eager(options: CompileOptions, device: str) -> str:
    """Why the glue between blocks runs eagerly on `device` with these options ('' when it is compiled)."""
    if options.glue_regions == "on":
        return ""
    if options.glue_regions == "off":
        return "glue_regions: off"
    if not gpu_choice.compiles_glue_by_default(device):
        return f"glue_regions auto compiles it on {', '.join(sorted(gpu_choice.GLUE_COMPILED_BY_DEFAULT))} only"
    if not options.measure_regions or not may_stay_eager(options, device):
        return ("glue_regions auto compiles it only where each region's choice is measured (not with "
                "measure_regions: false, autotuning or cuda_graphs: on); glue_regions: on compiles it anyway")
    return ""


def glue_regions(model: torch.nn.Module, regions: list[tuple[Region, list[torch.nn.Module]]],
                 options: CompileOptions, device: str, label: str) -> list[tuple[Region, list[torch.nn.Module]]]:
    """The regions of `model`'s glue, to compile beside its block `regions` on `device` ([] when the glue
    runs eagerly: said in the log where the option or CUDA asked for it)."""
    why = why_glue_eager(options, device)
    if why:
        say = log.info if options.glue_regions != "auto" or gpu_choice.compiles_glue_by_default(device) else log.debug
        say("Kiln: %s: the glue between its blocks runs eagerly: %s", label, why)
        return []
    found = find_glue(model, [block for _, blocks in regions for block in blocks])
    glue = grouped(found, first_index=len(regions), prefix=GLUE_PREFIX)
    if glue:
        log.info("Kiln: %s compiles the glue between its blocks as %d region(s) of its own, each kept compiled "
                 "where it measures faster: %s", label, len(glue), ", ".join(path for path, _ in found))
    else:
        log.info("Kiln: %s: no glue module outside its blocks to compile (only lone layers and the model's "
                 "own forward)", label)
    return glue


def model_device(module: torch.nn.Module) -> str:
    """The device type of `module`'s first parameter ("cpu" without any): where its glue would run."""
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"
