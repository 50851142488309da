"""Which shapes get a specialised variant, and how many variants a model may keep.

Kiln's default graph is dynamic in batch and resolution, so a new batch size or resolution runs
at once with no compile. Specialising lowers that same captured graph again with every size
fixed (static kernels, no TorchDynamo capture and no passes): worth it for the resolutions a user
samples most, on a GPU, in mode `max`. The policy says which shapes those are:

    shapes:
      specialize: none | pinned | buckets   # buckets: pinned + resolution_buckets.yaml; pins need pinned or buckets
      buckets: [sd15, sdxl, flux]          # names from resolution_buckets.yaml, or [[w, h], ...]
      pin: ["1024x1024", "832x1216:2"]      # WxH pixels, ":B" = the batch the model sees (CFG included)
      max_variants: 8                       # specialised variants kept (least recently used evicted)
      max_cuda_graphs: 8                    # with cuda_graphs on: shape signatures that record one

A workflow is untrusted, so every size is bounded (named constants below): a width or height, of a
pin or a [w, h] bucket, is a multiple of LATENT_FACTOR (8) up to MAX_SIZE (16384, ComfyUI's largest
resolution); a pin's batch is at most MAX_BATCH (64), and its width x height x batch at most
MAX_PIN_PIXELS (4096x4096 at batch 4; a pin without ":B" is held to it at the first call's batch
when compiled ahead, and its variant fails, logged and recorded, if over); there are at most
`max_variants` pins (more would be compiled ahead and evicted at once); `max_variants` and
`max_cuda_graphs` are at most MAX_KEPT (64); the `pin_shapes` text is at most
option_text.MAX_TEXT_CHARS characters, as the other option texts are.

Compiled whole, pinned shapes are compiled ahead, with the first compile; bucket resolutions when
first sampled at the batch the model first ran at (a new batch never compiles unless pinned). The
first call's own shape, pinned or a bucket, is specialised with the first compile too. By blocks,
each region's graph gets its static variants when the model first runs at a pinned or bucket shape
(compiler/shapes/shape_manager.py).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from .option_text import MAX_TEXT_CHARS, check_keys, shorten

SPECIALIZE = ("none", "pinned", "buckets")
LATENT_FACTOR = 8  # image pixels per latent pixel (SD1.5, SDXL, SD3, Flux)
MAX_SIZE = 16384  # pixels, a pin's or bucket's width or height: ComfyUI's MAX_RESOLUTION
MAX_BATCH = 64  # a pin's batch
MAX_PIN_PIXELS = 4096 * 4096 * 4  # a pin's width x height x batch: its activations are allocated to compile it ahead
MAX_KEPT = 64  # the largest max_variants and max_cuda_graphs (and so the most pins)
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
    problem = size_problem(width, height)
    if problem:
        raise ShapePolicyError(f"shapes.pin: {shorten(text)}: {problem}")
    if batch is not None and not 1 <= int(batch) <= MAX_BATCH:
        raise ShapePolicyError(f"shapes.pin: {shorten(text)}: the batch must be 1 to {MAX_BATCH}")
    problem = pixels_problem(width, height, int(batch or 1))
    if problem:
        raise ShapePolicyError(f"shapes.pin: {shorten(text)}: {problem}")
    return PinnedShape(width, height, int(batch) if batch else None)


def size_problem(width: int, height: int) -> str:
    """Why a pin's or bucket's width and height (pixels) are refused, or ''."""
    if width % LATENT_FACTOR or height % LATENT_FACTOR:
        return f"width and height must be multiples of {LATENT_FACTOR} (the latent scale)"
    if not (0 < width <= MAX_SIZE and 0 < height <= MAX_SIZE):
        return f"width and height must be {LATENT_FACTOR} to {MAX_SIZE} pixels"
    return ""


def pixels_problem(width: int, height: int, batch: int) -> str:
    """Why a pinned shape at this batch is too large to compile ahead (MAX_PIN_PIXELS), or ''."""
    if width * height * batch > MAX_PIN_PIXELS:
        return (f"{width}x{height} at batch {batch} is {width * height * batch:,} pixels; the limit is "
                f"{MAX_PIN_PIXELS:,} (4096x4096 at batch 4)")
    return ""


def parse_pins(value: Any) -> tuple[PinnedShape, ...]:
    """'1024x1024, 832x1216:2' or a list of such strings."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        if len(value.strip()) > MAX_TEXT_CHARS:  # the pin_shapes widget's text: bounded as every option text is
            raise ShapePolicyError(f"shapes.pin: the text is {len(value.strip()):,} characters long; the limit is {MAX_TEXT_CHARS:,}")
        items = value.replace(";", ",").split(",")
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise ShapePolicyError(f"shapes.pin={shorten(value)}: use WxH shapes, a list such as ['1024x1024', '832x1216:2'] "
                               "or one string '1024x1024, 832x1216:2'")
    return tuple(dict.fromkeys(parse_pin(item.strip() if isinstance(item, str) else item)
                               for item in items if not isinstance(item, str) or item.strip()))


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
        elif isinstance(item, (list, tuple)) and len(item) == 2 and all(_is_whole_number(v) for v in item):
            problem = size_problem(item[0], item[1])
            if problem:
                raise ShapePolicyError(f"shapes.buckets: {shorten(item)}: {problem}")
            sizes.append((item[0], item[1]))
        else:
            raise ShapePolicyError(f"shapes.buckets: {shorten(item)} is neither a bucket list name nor [width, height] "
                                   "in whole pixels")
    return tuple(dict.fromkeys(sizes))


def _is_whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        if not isinstance(self.max_variants, int) or isinstance(self.max_variants, bool) or not 1 <= self.max_variants <= MAX_KEPT:
            raise ShapePolicyError(f"shapes.max_variants={shorten(self.max_variants)}: use a whole number from 1 to {MAX_KEPT}")
        if (not isinstance(self.max_cuda_graphs, int) or isinstance(self.max_cuda_graphs, bool)
                or not 0 <= self.max_cuda_graphs <= MAX_KEPT):
            raise ShapePolicyError(f"shapes.max_cuda_graphs={shorten(self.max_cuda_graphs)}: use a whole number from 0 to {MAX_KEPT}")
        if self.pin and self.specialize == "none":
            raise ShapePolicyError("shapes.pin with shapes.specialize: none: the pins would never be specialised; "
                                   "drop specialize (pins imply pinned) or use pinned or buckets")
        if len(self.pin) > self.max_variants:
            raise ShapePolicyError(f"shapes.pin: {len(self.pin)} pinned shapes, more than shapes.max_variants={self.max_variants} "
                                   "(the rest would be compiled ahead and evicted at once); pin fewer or raise "
                                   f"max_variants (at most {MAX_KEPT})")

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
