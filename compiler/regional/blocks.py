"""Compile units: the blocks a diffusion model repeats, grouped so each distinct one compiles once.

A diffusion model is a few block types repeated many times (SD1.5's UNet: 22 residual and 16
transformer blocks; Flux: 19 double and 38 single blocks). Compiling the whole model traces and
lowers every repetition again; compiling each *distinct* block once and running every identical
block through that code costs only the distinct ones (`compile_unit: blocks`).

Which modules are blocks, by structure alone (no list of model classes to keep up to date):

- a *block list* is a ModuleList or Sequential (ComfyUI's TimestepEmbedSequential included) whose
  elements include blocks: `input_blocks`, `down_blocks[0].resnets`, `transformer_blocks`, ...
- a *block* is a module with parameters of a class of the model's own (not a torch.nn layer such as
  Linear or Conv2d, nor a subclass of one like ComfyUI's ops); an element of a block list is a
  block, unless it is a container itself or holds a block list whose elements repeat: then the walk
  goes on inside it (SDXL's 10-deep SpatialTransformer splits into its 10 identical
  BasicTransformerBlocks; SD1.5's 1-deep one stays one block, glue included);
- blocks never nest, and what is not in a block (embeddings, conv_in, the final norm, the loops
  between blocks) runs as it is, eagerly: it is a small part of a step. On CUDA its modules may be
  compiled as regions of their own (`glue_regions`, compiler/regional/glue.py), named GLUE_PREFIX + class.

Two blocks share a region, and so one compiled code, when their signature is equal: class,
parameter and buffer names, shapes, dtypes and devices, and the plain attributes (ints, floats,
strings, flags) of the block and its submodules, which its code may read. TorchDynamo's guards
still check every call, so a signature that misses something costs a recompile, never a wrong result.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)
_NOT_LAYERS = (torch.nn.Module, torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
_PLAIN = (int, float, bool, str, type(None))
GLUE_PREFIX = "glue."  # a glue region's name: "glue.TimestepEmbedding#1" (compiler/regional/glue.py)


@dataclass(frozen=True)
class Region:
    """One distinct block: compiled once, run for every block in `members` (their paths in the model)."""

    index: int
    name: str                    # "ResnetBlock2D#2": the class, and which of its distinct shapes
    members: tuple[str, ...]     # "down_blocks.0.resnets.0", ...
    signature: str = ""          # what its blocks share (signature()): keys what is kept of it across starts

    @property
    def glue(self) -> bool:
        """A region of the model's glue, not of its blocks (compiler/regional/glue.py)."""
        return self.name.startswith(GLUE_PREFIX)

    @property
    def block_class(self) -> str:
        """The blocks' class name ("ResnetBlock2D"), which regions of other shapes share."""
        return self.name.rpartition("#")[0] or self.name

    def line(self) -> str:
        shown = ", ".join(self.members[:3]) + (f", ... ({len(self.members)} blocks)" if len(self.members) > 3 else "")
        return f"region {self.index} {self.name}: {shown}"


def is_layer(module: torch.nn.Module) -> bool:
    """A torch.nn layer (Linear, Conv2d, GroupNorm...) or a subclass of one (ComfyUI's ops)."""
    return any(cls.__module__.startswith("torch.nn.") and cls not in _NOT_LAYERS for cls in type(module).__mro__)


def is_block(module: torch.nn.Module) -> bool:
    return not is_layer(module) and next(module.parameters(), None) is not None


def _is_block_list(module: torch.nn.Module) -> bool:
    return isinstance(module, _CONTAINERS) and any(is_block(m) for m in module.children())


def signature(block: torch.nn.Module) -> str:
    """What decides whether two blocks run the same compiled code (see the module docstring)."""
    cls = type(block)
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for name, tensor in (*block.named_parameters(), *block.named_buffers()):
        parts.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}:{type(tensor).__name__}")
    for path, sub in block.named_modules():
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                parts.append(f"{path}.{key}={value!r}")
            elif callable(value) and not isinstance(value, torch.nn.Module):
                parts.append(f"{path}.{key}={getattr(value, '__qualname__', type(value).__qualname__)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def find_blocks(model: torch.nn.Module, signatures: Optional[dict] = None) -> list[tuple[str, torch.nn.Module]]:
    """(path, block) for every block of `model`, in model order (see the module docstring).
    `signatures` ({module: signature}) keeps those computed on the way, for the caller to reuse."""
    found: list[tuple[str, torch.nn.Module]] = []
    signatures = {} if signatures is None else signatures

    def signature_of(module: torch.nn.Module) -> str:
        if module not in signatures:
            signatures[module] = signature(module)
        return signatures[module]

    def _repeats(block_list: torch.nn.Module) -> bool:
        counts = Counter(signature_of(m) for m in block_list.children() if is_block(m))
        return any(n > 1 for n in counts.values())

    def split(module: torch.nn.Module) -> bool:
        return any(_is_block_list(child) and _repeats(child) for child in module.children())

    def elements(block_list: torch.nn.Module, path: str) -> None:
        for name, element in block_list.named_children():
            element_path = f"{path}.{name}"
            if not is_block(element):
                continue
            if isinstance(element, _CONTAINERS):  # ComfyUI's TimestepEmbedSequential: a list inside the list
                elements(element, element_path)
            elif split(element):
                walk(element, element_path + ".")
            else:
                found.append((element_path, element))

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if _is_block_list(child):
                elements(child, f"{prefix}{name}")
            else:
                walk(child, f"{prefix}{name}.")

    walk(model, "")
    return found


def regions_of(model: torch.nn.Module) -> list[tuple[Region, list[torch.nn.Module]]]:
    """The model's blocks grouped into regions (one per distinct signature, in model order), each
    with its blocks."""
    signatures: dict = {}
    return grouped(find_blocks(model, signatures), signatures)


def grouped(found: list[tuple[str, torch.nn.Module]], signatures: Optional[dict] = None, first_index: int = 0,
            prefix: str = "") -> list[tuple[Region, list[torch.nn.Module]]]:
    """(path, module) pairs grouped into regions, one per distinct signature, in their order, indexed from
    `first_index` and named `prefix` + class + "#n"."""
    groups: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    signatures = {} if signatures is None else signatures
    for path, block in found:
        key = signatures.get(block) or signature(block)
        groups.setdefault(key, []).append((path, block))
    per_class: Counter = Counter()
    regions = []
    for index, (key, members) in enumerate(groups.items(), first_index):
        cls = type(members[0][1]).__name__
        per_class[cls] += 1
        region = Region(index=index, name=f"{prefix}{cls}#{per_class[cls]}", members=tuple(p for p, _ in members),
                        signature=key)
        regions.append((region, [b for _, b in members]))
    return regions


def has_repeated_blocks(regions: list[tuple[Region, list[torch.nn.Module]]]) -> bool:
    return any(len(region.members) > 1 for region, _ in regions if not region.glue)
