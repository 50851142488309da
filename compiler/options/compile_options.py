"""Compile options: one typed, documented dataclass, presets by mode, and the expert string.

`CompileOptions` is what `kiln.compile` and the Compile UNet node both build. Experts pass
extra settings as a JSON or YAML mapping (`parse_expert_options`), validated with errors that
name the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ...choices import COMPILE_UNITS, CUDA_GRAPHS, DEFAULT_GLUE_REGIONS, GLUE_REGIONS
from .inductor_settings import setting_problem
from .modes import LOWERINGS, MODES, Lowering
from .option_text import parse_mapping_text, shorten
from .shape_policy import ShapePolicy, ShapePolicyError

# Pass switches: "auto" lets each pass decide (its extra_check), "on" forces it where it matches
# (e.g. to use a Kiln kernel on a CPU, where the pass would otherwise leave Inductor to fuse),
# "off" disables it.
PASS_SWITCHES = ("auto", "on", "off")

# choices.CUDA_GRAPHS by name -> the value CompileOptions.cuda_graphs holds (None: auto, as `dynamic`'s)
CUDA_GRAPH_VALUES = {"auto": None, "on": True, "off": False}
assert tuple(CUDA_GRAPH_VALUES) == tuple(CUDA_GRAPHS), "one value per choices.CUDA_GRAPHS name, in its order"


class OptionsError(ValueError):
    """A compile option is invalid; the message names the option and what is allowed."""


@dataclass(frozen=True)
class CompileOptions:
    """How Kiln compiles a diffusion model.

    mode: "fast" | "balanced" | "max" (see MODE_HELP).
    dynamic: None ("auto"): the batch and the latent's resolution are dynamic from the first
        compile (one graph for every batch >= 2 and every resolution), other sizes become dynamic
        when they first change; True: every size is dynamic from the start; False: every shape
        is specialised (a TorchDynamo recompile per new shape).
    cuda_graphs: None ("auto", the default): on a CUDA device the whole model call is recorded and
        replayed as a CUDA graph where the rules hold (compiler/graphs; elsewhere nothing changes and
        nothing is said); True ("on"): torch's CUDA graph trees for each compiled graph (CUDA only; on
        other devices it is ignored with a warning); False ("off"): none. choices.CUDA_GRAPHS.
    passes: per-pass switch, {pass name: "auto" | "on" | "off"}; unnamed passes are "auto".
    fullgraph: fail instead of splitting the model at a graph break.
    inductor: extra Inductor config applied only while Kiln compiles (scoped `config.patch`),
        e.g. {"coordinate_descent_tuning": True}; tuning settings only (compiler/options/inductor_settings.py:
        no programs, paths, caches or hooks). Never changes the global Inductor config.
    shapes: which shapes get a static variant of their own and how many are kept (ShapePolicy;
        a mapping such as {"specialize": "buckets", "pin": ["1024x1024"], "max_variants": 8}).
        Compiled whole, pinned shapes get theirs ahead, with the first compile, and with pins auto
        compiles whole; by blocks (auto with specialize alone, or blocks) each region's graph gets
        static variants for a pinned or bucket shape when the model first runs at it.
    compile_unit: "auto" | "blocks" | "whole" (choices.COMPILE_UNITS; compiler/regional/blocks.py): compile each
        distinct block once and share it between identical blocks, or the whole model as one graph.
    measure_regions: by blocks, time each region's first call compiled and eagerly and keep the
        faster, leave a block class uncompiled once its first regions gained under 10%, and on a
        CPU leave blocks with most of their weights in convolutions uncompiled (measured no faster
        there; compiler/regional/region_choice.py); false compiles every region with something to fuse.
    background: by blocks, lower each region in a thread of Kiln's while its blocks run eagerly: the
        first image does not wait for the compile, and each region runs compiled from its first call
        after its code is ready (compiler/regional/background.py). Not with cuda_graphs or compile_unit whole.
    glue_regions: "auto" | "on" | "off" (choices.GLUE_REGIONS; compiler/regional/glue.py): by blocks, compile
        the model's own modules outside its blocks (time embeddings, final norms) as regions of their own,
        each kept compiled where it measures faster: auto on CUDA where region choices are measured, on
        everywhere; off never.
    """

    mode: str = "balanced"
    dynamic: Optional[bool] = None
    cuda_graphs: Optional[bool] = None
    passes: Mapping[str, str] = field(default_factory=dict)
    fullgraph: bool = False
    inductor: Mapping[str, Any] = field(default_factory=dict)
    shapes: ShapePolicy = field(default_factory=ShapePolicy)
    compile_unit: str = "auto"
    measure_regions: bool = True
    background: bool = False
    glue_regions: str = DEFAULT_GLUE_REGIONS

    def __post_init__(self):
        if self.mode not in MODES:
            raise OptionsError(f"mode={shorten(self.mode)} is not a Kiln mode; use one of {', '.join(MODES)}")
        if not isinstance(self.compile_unit, str) or self.compile_unit not in COMPILE_UNITS:
            raise OptionsError(f"compile_unit={shorten(self.compile_unit)}: use one of {', '.join(COMPILE_UNITS)}")
        if not (self.dynamic is None or isinstance(self.dynamic, bool)):
            raise OptionsError(f"dynamic={shorten(self.dynamic)}: use true, false or null (let TorchDynamo decide)")
        if isinstance(self.cuda_graphs, str) and self.cuda_graphs in CUDA_GRAPH_VALUES:
            object.__setattr__(self, "cuda_graphs", CUDA_GRAPH_VALUES[self.cuda_graphs])
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            raise OptionsError(f"cuda_graphs={shorten(self.cuda_graphs)}: use one of {', '.join(CUDA_GRAPHS)}")
        if isinstance(self.glue_regions, bool):  # YAML's bare on/off
            object.__setattr__(self, "glue_regions", "on" if self.glue_regions else "off")
        if not isinstance(self.glue_regions, str) or self.glue_regions not in GLUE_REGIONS:
            raise OptionsError(f"glue_regions={shorten(self.glue_regions)}: use one of {', '.join(GLUE_REGIONS)}")
        for key in ("fullgraph", "measure_regions", "background"):
            if not isinstance(getattr(self, key), bool):
                raise OptionsError(f"{key}={shorten(getattr(self, key))}: use true or false")
        object.__setattr__(self, "passes", _pass_switches(self.passes))
        object.__setattr__(self, "inductor", _inductor_settings(self.inductor))
        if self.inductor and not self.lowering.uses_inductor:
            raise OptionsError(f"inductor options have no effect in mode {self.mode!r} (no Inductor); use 'balanced' or 'max'")
        try:
            object.__setattr__(self, "shapes", ShapePolicy.from_mapping(self.shapes))
        except ShapePolicyError as exc:
            raise OptionsError(str(exc)) from None
        if self.shapes.specialize != "none" and not self.lowering.can_specialise:
            raise OptionsError(f"shapes.specialize has no effect in mode {self.mode!r} (its FX graph runs every shape as it is); "
                               "use 'balanced' or 'max'")
        if self.dynamic is False and (self.shapes.specialize != "none" or self.shapes.pin):
            raise OptionsError("shapes.pin and shapes.specialize need dynamic auto or true: with dynamic=false TorchDynamo "
                               "specialises every shape itself (each new shape recompiles, with static kernels), so there "
                               "is no dynamic graph to pin shapes ahead of; drop the pins or use dynamic auto")
        if self.background and self.compile_unit == "whole":
            raise OptionsError("background lowers block regions while the others run; with compile_unit: whole there "
                               "is one graph, which the first call waits for: use compile_unit: auto or blocks, or "
                               "drop background")
        if self.background and self.cuda_graphs:
            raise OptionsError("background and cuda_graphs: CUDA graphs are recorded on the thread that runs the "
                               "model, not beside it; drop one of them")

    @property
    def pins_shapes(self) -> bool:
        """The shape policy asks for static variants (of the whole model's graph, or of each region's)."""
        return self.shapes.specialize != "none" or bool(self.shapes.pin)

    @property
    def symbolic_sizes(self) -> bool:
        """Captures see symbolic sizes: Kiln marks batch and resolution dynamic (auto) or `dynamic=True`."""
        return self.dynamic is not False

    @property
    def cuda_graphs_choice(self) -> str:
        """The name of the cuda_graphs choice (choices.CUDA_GRAPHS)."""
        return next(name for name, value in CUDA_GRAPH_VALUES.items() if value is self.cuda_graphs)

    def whole_call_graphs(self, device: str) -> bool:
        """Whether a model on `device` records and replays its whole calls (cuda_graphs auto, on CUDA)."""
        return self.cuda_graphs is None and str(device).startswith("cuda")

    @property
    def lowering(self) -> Lowering:
        """What this mode's lowering is allowed and does (compiler/options/modes.py)."""
        return LOWERINGS[self.mode]

    def switch(self, pass_name: str) -> str:
        return dict(self.passes).get(pass_name, "auto")

    def replace(self, **changes) -> "CompileOptions":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "dynamic": self.dynamic,
            "cuda_graphs": self.cuda_graphs,
            "passes": dict(self.passes),
            "fullgraph": self.fullgraph,
            "inductor": dict(self.inductor),
            "shapes": self.shapes.as_dict(),
            "compile_unit": self.compile_unit,
            "measure_regions": self.measure_regions,
            "background": self.background,
            "glue_regions": self.glue_regions,
        }


def _pass_switches(passes: Any) -> dict[str, str]:
    """{pass name: "auto" | "on" | "off"}, checked; YAML's bare on/off (booleans) read as "on"/"off"."""
    from ..passes import PASS_NAMES  # local: passes import this module

    if passes is None:  # an empty `passes:` section
        return {}
    if not isinstance(passes, Mapping):
        raise OptionsError(f"passes={shorten(passes)}: use a mapping {{pass name: {' | '.join(PASS_SWITCHES)}}}; "
                           f"Kiln's passes are {', '.join(PASS_NAMES)}")
    switches = {}
    for name, switch in passes.items():
        if name not in PASS_NAMES:
            raise OptionsError(f"passes: unknown pass {shorten(name)}; Kiln's passes are {', '.join(PASS_NAMES)}")
        if isinstance(switch, bool):
            switch = "on" if switch else "off"
        if not isinstance(switch, str) or switch not in PASS_SWITCHES:
            raise OptionsError(f"passes.{name}={shorten(switch)}: use one of {', '.join(PASS_SWITCHES)}")
        switches[name] = switch
    return switches


def _inductor_settings(settings: Any) -> dict[str, Any]:
    """{Inductor setting: value}, each a tuning setting a workflow may change (compiler/options/inductor_settings.py)."""
    if settings is None:  # an empty `inductor:` section
        return {}
    if not isinstance(settings, Mapping):
        raise OptionsError(f"inductor={shorten(settings)}: use a mapping of Inductor tuning settings to values, "
                           "e.g. {coordinate_descent_tuning: true}")
    for name, value in settings.items():
        problem = setting_problem(name, value)
        if problem:
            raise OptionsError(problem)
    return dict(settings)


# `cache` is the plan's cache part (compiler/cache), set from the same string: see plan.build_options
_EXPERT_KEYS = tuple(f.name for f in dataclasses.fields(CompileOptions)) + ("cache",)


def parse_expert_options(text: str) -> dict:
    """Parse the node's advanced string (JSON or YAML mapping) into CompileOptions fields (read with
    compiler/options/option_text.py's bounds: size, depth, no YAML aliases).

    >>> parse_expert_options('passes: {channels_last_convs: off}')
    {'passes': {'channels_last_convs': False}}
    """
    return parse_mapping_text(text, "advanced options", _EXPERT_KEYS, OptionsError)
