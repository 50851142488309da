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

Pinned shapes are compiled ahead, with the first compile; bucket resolutions when first sampled
at the batch the model first ran at (a new batch never compiles unless pinned). The first call's
own shape, pinned or a bucket, is specialised with the first compile too.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

SPECIALIZE = ("none", "pinned", "buckets")
LATENT_FACTOR = 8  # image pixels per latent pixel (SD1.5, SDXL, SD3, Flux)
_PIN = re.compile(r"^\s*(\d+)\s*[x×]\s*(\d+)\s*(?::\s*(\d+))?\s*$")


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
    match = _PIN.match(str(text))
    if not match:
        raise ShapePolicyError(f"shapes.pin: {text!r} is not a shape; write WxH in pixels, e.g. 1024x1024 or 1024x1024:2")
    width, height, batch = int(match[1]), int(match[2]), match[3]
    if width % LATENT_FACTOR or height % LATENT_FACTOR:
        raise ShapePolicyError(f"shapes.pin: {text!r}: width and height must be multiples of {LATENT_FACTOR} (the latent scale)")
    if batch is not None and int(batch) < 1:
        raise ShapePolicyError(f"shapes.pin: {text!r}: the batch must be at least 1")
    return PinnedShape(width, height, int(batch) if batch else None)


def parse_pins(value: Any) -> tuple[PinnedShape, ...]:
    """'1024x1024, 832x1216:2' or a list of such strings."""
    if value is None or value == "":
        return ()
    items = value.replace(";", ",").split(",") if isinstance(value, str) else list(value)
    return tuple(parse_pin(str(item).strip()) for item in items if str(item).strip())


def _buckets(value: Any) -> tuple[tuple[int, int], ...]:
    table = bucket_table()
    names = [value] if isinstance(value, str) else list(value)
    sizes: list[tuple[int, int]] = []
    for item in names:
        if isinstance(item, str):
            if item not in table:
                raise ShapePolicyError(f"shapes.buckets: unknown bucket list {item!r}; known: {', '.join(table)} (or [[w, h], ...])")
            sizes += table[item]
        elif isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(v, int) for v in item):
            sizes.append((item[0], item[1]))
        else:
            raise ShapePolicyError(f"shapes.buckets: {item!r} is neither a bucket list name nor [width, height]")
    return tuple(dict.fromkeys(sizes))


@dataclass(frozen=True)
class ShapePolicy:
    specialize: str = "none"
    buckets: tuple[tuple[int, int], ...] = field(default_factory=lambda: _buckets(list(bucket_table())))
    pin: tuple[PinnedShape, ...] = ()
    max_variants: int = 8
    max_cuda_graphs: int = 8

    def __post_init__(self):
        if self.specialize not in SPECIALIZE:
            raise ShapePolicyError(f"shapes.specialize={self.specialize!r}: use one of {', '.join(SPECIALIZE)}")
        if not isinstance(self.max_variants, int) or isinstance(self.max_variants, bool) or self.max_variants < 1:
            raise ShapePolicyError(f"shapes.max_variants={self.max_variants!r}: use a whole number >= 1")
        if not isinstance(self.max_cuda_graphs, int) or isinstance(self.max_cuda_graphs, bool) or self.max_cuda_graphs < 0:
            raise ShapePolicyError(f"shapes.max_cuda_graphs={self.max_cuda_graphs!r}: use a whole number >= 0")

    @classmethod
    def from_mapping(cls, data: Optional[Mapping]) -> "ShapePolicy":
        if isinstance(data, ShapePolicy):
            return data
        data = dict(data or {})
        unknown = sorted(set(data) - {"specialize", "buckets", "pin", "max_variants", "max_cuda_graphs"})
        if unknown:
            raise ShapePolicyError(f"shapes: unknown key(s) {', '.join(map(repr, unknown))}; "
                                   "allowed: specialize, buckets, pin, max_variants, max_cuda_graphs")
        fields: dict = {}
        if "specialize" in data:
            fields["specialize"] = {False: "none", None: "none"}.get(data["specialize"], data["specialize"])
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
