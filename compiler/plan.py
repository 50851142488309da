"""A Kiln plan: everything Kiln will do to one diffusion model, declared before anything runs.

ComfyUI's Kiln nodes each add their part to the plan carried by a MODEL (in its model options),
in whatever order they were chained; `kiln.compile` makes a plan with one part. `KilnModel`
(compiler/model.py) executes a plan on the model's first call, always in `STEPS` order.
Two plans with the same parts are equal, whichever order the parts were added in.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Optional

from .cache import CacheOptions, CacheOptionsError
from .options.option_text import flatten
from .options.compile_options import CompileOptions, OptionsError, parse_expert_options
from .quantize import QuantizeOptions

# The order a plan's parts run in, whatever order they were declared in: quantization comes before
# "compile" (it changes the layers the compiler captures). Quantizing makes new weights, so it is
# carried out when it is declared (the Quantize node, `kiln.quantize`): the module a KilnModel
# wraps is already quantized, and the part records how, for the plan's key, log and report.
STEPS = ("quantize", "compile")
# A plan's parts: its steps, and "cache", which is not a step of its own: the compile step consults
# it (compiler/cache) for each graph it lowers, loading a stored lowering instead of compiling.
PARTS = STEPS + ("cache",)


@dataclass(frozen=True)
class KilnPlan:
    """quantize: how the model's weights were quantized (None: not quantized);
    compile: how the model is compiled (None: not compiled);
    cache: where and how compiled graphs are stored and loaded (None: not cached)."""

    quantize: Optional[QuantizeOptions] = None
    compile: Optional[CompileOptions] = None
    cache: Optional[CacheOptions] = None

    def with_parts(self, **parts) -> "KilnPlan":
        """This plan with the given parts set (a part declared again replaces the earlier one)."""
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise ValueError(f"a Kiln plan has no part {', '.join(map(repr, unknown))}; its parts are {', '.join(PARTS)}")
        return dataclasses.replace(self, **parts)

    def as_dict(self) -> dict:
        return {name: (part.as_dict() if (part := getattr(self, name)) is not None else None) for name in PARTS}

    @functools.cached_property
    def key(self) -> str:
        """Equal for equal plans: what a model's compiled variants are memoised under (computed once:
        ComfyUI's wrapper looks the model up by it on every sampling step)."""
        return json.dumps(self.as_dict(), sort_keys=True, default=str)

    def changes_from(self, other: "KilnPlan") -> list[str]:
        """What differs from `other`, one 'compile.mode: balanced -> max' line per setting."""
        before, after = flatten(other.as_dict()), flatten(self.as_dict())
        return [f"{name}: {_show(before.get(name))} -> {_show(after.get(name))}"
                for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]

    def cache_unused(self) -> str:
        """Why the plan's cache stores nothing for its compile ("" if it does, or there is no cache or
        compile): Kiln's cache keeps Inductor's work, and a mode without Inductor has none."""
        if self.cache is None or self.compile is None or self.compile.lowering.uses_inductor:
            return ""
        return f"Kiln's cache stores Inductor's work; mode {self.compile.mode!r} has none (nothing is cached)"

    def describe(self) -> str:
        parts = []
        if self.quantize is not None:
            parts.append(f"quantize ({self.quantize.scheme})")
        if self.compile is not None:
            c = self.compile
            dynamic = {None: "auto", True: "true", False: "false"}[c.dynamic]
            parts.append(f"compile ({c.mode}, dynamic={dynamic}, cuda_graphs={c.cuda_graphs_choice})")
        text = ", then ".join(parts) or "nothing"
        if self.cache is not None and self.cache.mode != "off":
            text += f", with Kiln's cache ({self.cache.mode}, {self.cache.root})"
        return text


def build_options(mode: str = "balanced", dynamic=None, cuda_graphs=None, advanced: str = "",
                  pin_shapes: str = "", **overrides) -> KilnPlan:
    """Widgets (or keyword arguments) plus the expert string -> a KilnPlan with every part they ask
    for: `compile` (validated CompileOptions) always, `cache` when the expert string has
    `cache: {dir: ..., mode: use, max_gb: 20}` (or `cache: /some/dir`; without a dir its `dir` is "",
    the caller's default). The expert string is parsed once. It wins over the widgets, keyword
    overrides win over both; `pin_shapes` ('1024x1024, 832x1216:2') adds pinned shapes (a bad one
    raises ShapePolicyError naming it)."""
    fields = {"mode": mode, "dynamic": dynamic, "cuda_graphs": cuda_graphs}
    fields.update(parse_expert_options(advanced))
    cache = fields.pop("cache", None)
    fields.update(overrides)
    options = CompileOptions(**fields)
    if str(pin_shapes or "").strip():
        options = options.replace(shapes=options.shapes.with_pins(pin_shapes))
    try:
        cache_options = CacheOptions.from_mapping(cache) if cache is not None else None
    except CacheOptionsError as exc:
        raise OptionsError(str(exc)) from None
    return KilnPlan(compile=options, cache=cache_options)


def _show(value: Any) -> str:
    return "unset" if value is None else json.dumps(value, default=str)
