"""The compile modes, described once: what each mode's lowering is allowed and does (choices.COMPILE_MODES
says what each means to a user). Everything that depends on the mode asks its `Lowering` (does it
use Inductor? can it lower a graph again with static sizes?) instead of comparing mode strings;
compiler/backend/lowering.py carries the lowering out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...choices import COMPILE_MODES


@dataclass(frozen=True)
class Lowering:
    mode: str               # a name of choices.COMPILE_MODES, which says what it means
    uses_inductor: bool     # Inductor generates the code (so `inductor` options apply, and it fuses neighbours itself)
    can_specialise: bool    # the shape manager may lower the captured graph again with static sizes
    inductor_preset: Optional[str] = None  # torch.compile(mode=...) settings applied on top, e.g. max-autotune

    @property
    def description(self) -> str:
        return COMPILE_MODES[self.mode]


LOWERINGS: dict[str, Lowering] = {lowering.mode: lowering for lowering in (
    Lowering("fast", uses_inductor=False, can_specialise=False),
    Lowering("balanced", uses_inductor=True, can_specialise=True),
    Lowering("max", uses_inductor=True, can_specialise=True, inductor_preset="max-autotune-no-cudagraphs"),
)}
assert tuple(LOWERINGS) == tuple(COMPILE_MODES), "one Lowering per compile mode of choices.py, in its order"
MODES = tuple(LOWERINGS)
