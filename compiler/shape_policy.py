"""Which shapes get a specialised variant, and how many variants a model may keep.

Kiln's default graph is dynamic in batch and resolution, so a new batch size or resolution runs
at once with no compile. Specialising lowers that same captured graph again with every size
fixed (static kernels, no TorchDynamo capture and no passes): worth it for the resolutions a user
samples most, on a GPU, in mode `max`. The policy says which shapes those are:

    shapes:
      specialize: none | pinned | buckets   # buckets: pinned + resolution_buckets.yaml
      buckets: [sd15, sdxl, flux]          # names from resolution_buckets.yaml, or [[w, h], ...]
      pin: ["1024x1024", "832x1216:2"]      # WxH pixels, ":B" = the batch the model sees (CFG included)
      max_variants: 8                       # specialised variants kept (least recently used evicted)
      max_cuda_graphs: 8                    # with cuda_graphs on: shape signatures that record one

Compiled whole, pinned shapes are compiled ahead, with the first compile; bucket resolutions when
first sampled at the batch the model first ran at (a new batch never compiles unless pinned). The
first call's own shape, pinned or a bucket, is specialised with the first compile too. By blocks,
each region's graph gets its static variants when the model first runs at a pinned or bucket shape
(compiler/shape_manager.py).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from .option_text import check_keys, shorten

SPECIALIZE = ("none", "pinned", "buckets")
LATENT_FACTOR = 8  # image pixels per latent pixel (SD1.5, SDXL, SD3, Flux)
_PIN = re.compile(r"^\s*(\d{1,6})\s*[x×]\s*(\d{1,6})\s*(?::\s*(\d{1,6}))?\s*$")  # digits bounded: int() stays cheap
_KEYS = ("specialize", "buckets", "pin", "max_variants", "max_cuda_graphs")


class ShapePolicyError(ValueError):
    """A `shapes` option is invalid; the message names it and what is allowed."""


@dataclass(frozen=True)
class PinnedShape:
    width: int             # pixels
    height: int
    batch: Optional[int]   # the batch the model sees; None: the batch of the first call

    @property
    def latent(self) -> tuple[int, int]:
        return self.height // LATENT_FACTOR, self.width // LATENT_FACTOR

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f":{self.batch}" if self.batch else "")


@functools.lru_cache(maxsize=None)
def bucket_table() -> dict[str, tuple[tuple[int, int], ...]]:
    import yaml

    with open(os.path.join(os.path.dirname(__file__), "resolution_buckets.yaml")) as f:
        data = yaml.safe_load(f)
    return {name: tuple((int(w), int(h)) for w, h in sizes) for name, sizes in data.items()}


def parse_pin(text: str) -> PinnedShape:
    match = _PIN.match(text) if isinstance(text, str) else None
    if not match:
        raise ShapePolicyError(f"shapes.pin: {shorten(text)} is not a shape; write WxH in pixels, e.g. 1024x1024 or 1024x1024:2")
    width, height, batch = int(match[1]), int(match[2]), match[3]
    if width % LATENT_FACTOR or height % LATENT_FACTOR:
        raise ShapePolicyError(f"shapes.pin: {shorten(text)}: width and height must be multiples of {LATENT_FACTOR} (the latent scale)")
    if batch is not None and int(batch) < 1:
        raise ShapePolicyError(f"shapes.pin: {shorten(text)}: the batch must be at least 1")
    return PinnedShape(width, height, int(batch) if batch else None)


def parse_pins(value: Any) -> tuple[PinnedShape, ...]:
    """'1024x1024, 832x1216:2' or a list of such strings."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        items = value.replace(";", ",").split(",")
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise ShapePolicyError(f"shapes.pin={shorten(value)}: use WxH shapes, a list such as ['1024x1024', '832x1216:2'] "
                               "or one string '1024x1024, 832x1216:2'")
    return tuple(parse_pin(item.strip() if isinstance(item, str) else item)
                 for item in items if not isinstance(item, str) or item.strip())


def _buckets(value: Any) -> tuple[tuple[int, int], ...]:
    table = bucket_table()
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, (list, tuple)):
        names = value
    else:
        raise ShapePolicyError(f"shapes.buckets={shorten(value)}: use a list of bucket list names ({', '.join(table)}) "
                               "and [width, height] pairs")
    sizes: list[tuple[int, int]] = []
    for item in names:
        if isinstance(item, str) and item in table:
            sizes += table[item]
        elif isinstance(item, str):
            raise ShapePolicyError(f"shapes.buckets: unknown bucket list {shorten(item)}; known: {', '.join(table)} (or [[w, h], ...])")
        elif isinstance(item, (list, tuple)) and len(item) == 2 and all(_is_size(v) for v in item):
            sizes.append((item[0], item[1]))
        else:
            raise ShapePolicyError(f"shapes.buckets: {shorten(item)} is neither a bucket list name nor [width, height] "
                                   "in whole pixels >= 1")
    return tuple(dict.fromkeys(sizes))


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _specialize(value: Any) -> Any:
    """YAML's `specialize: off` (false) and an empty `specialize:` (null) mean none."""
    return "none" if value is None or value is False else value


@dataclass(frozen=True)
class ShapePolicy:
    specialize: str = "none"
    buckets: tuple[tuple[int, int], ...] = field(default_factory=lambda: _buckets(list(bucket_table())))
    pin: tuple[PinnedShape, ...] = ()
    max_variants: int = 8
    max_cuda_graphs: int = 8

    def __post_init__(self):
        if not isinstance(self.specialize, str) or self.specialize not in SPECIALIZE:
            raise ShapePolicyError(f"shapes.specialize={shorten(self.specialize)}: use one of {', '.join(SPECIALIZE)}")
        if not isinstance(self.max_variants, int) or isinstance(self.max_variants, bool) or self.max_variants < 1:
            raise ShapePolicyError(f"shapes.max_variants={shorten(self.max_variants)}: use a whole number >= 1")
        if not isinstance(self.max_cuda_graphs, int) or isinstance(self.max_cuda_graphs, bool) or self.max_cuda_graphs < 0:
            raise ShapePolicyError(f"shapes.max_cuda_graphs={shorten(self.max_cuda_graphs)}: use a whole number >= 0")

    @classmethod
    def from_mapping(cls, data: Optional[Mapping]) -> "ShapePolicy":
        if isinstance(data, ShapePolicy):
            return data
        if data is None:  # an empty `shapes:` section
            return cls()
        if not isinstance(data, Mapping):
            raise ShapePolicyError(f"shapes={shorten(data)}: use a mapping with keys {', '.join(_KEYS)}, "
                                   "e.g. {specialize: buckets, max_variants: 4}")
        check_keys(data, _KEYS, "shapes", ShapePolicyError)
        fields: dict = {}
        if "specialize" in data:
            fields["specialize"] = _specialize(data["specialize"])
        if "buckets" in data:
            fields["buckets"] = _buckets(data["buckets"])
        if "pin" in data:
            fields["pin"] = parse_pins(data["pin"])
            fields.setdefault("specialize", "pinned")
        for key in ("max_variants", "max_cuda_graphs"):
            if key in data:
                fields[key] = data[key]
        return cls(**fields)

    def with_pins(self, text) -> "ShapePolicy":
        """This policy plus the pinned shapes in `text` ('1024x1024, 832x1216:2')."""
        return replace(self, pin=tuple(dict.fromkeys(self.pin + parse_pins(text))),
                       specialize="pinned" if self.specialize == "none" else self.specialize)

    def wants_specialised(self, latent_hw: Optional[tuple[int, int]], batch: Optional[int], first_batch: Optional[int]) -> bool:
        """Should a signature with this latent size and batch get a static variant of its own?"""
        if self.specialize == "none" or latent_hw is None:
            return False
        for pin in self.pin:
            if pin.latent == latent_hw and (pin.batch or first_batch) == batch:
                return True
        if self.specialize == "buckets" and batch == first_batch:  # other batches: the dynamic graph, no compile
            return any((h // LATENT_FACTOR, w // LATENT_FACTOR) == latent_hw for w, h in self.buckets)
        return False

    def as_dict(self) -> dict:
        return {"specialize": self.specialize, "pin": [str(p) for p in self.pin], "max_variants": self.max_variants,
                "max_cuda_graphs": self.max_cuda_graphs,
                "buckets": [f"{w}x{h}" for w, h in self.buckets]}
