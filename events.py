"""What Kiln tells a watcher as it compiles: typed records with one JSON form, standard library only.

The compiler makes a `CompileEvent` for each graph it compiles (`GraphCompile.event()`,
compiler/stats.py); ComfyUI's Kiln nodes show its `line()` on themselves (progress text) and send
the record itself as a websocket message of type COMPILE_EVENT (nodes/plan_wrapper.py); `kiln
queue` decodes that message with `CompileEvent.from_message` (client/follow.py) and adds up the
compile time from the records, never from the shown text. Neither side needs torch to read it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

COMPILE_EVENT = "kiln.compile"  # the websocket message's type


@dataclass(frozen=True)
class CompileEvent:
    """One graph compiled: its number, the time it took (TorchDynamo's capture, Kiln's passes and
    the lowering, to a tenth of a second, as shown), how it was lowered ("fx", "inductor", ...),
    whether its shapes are symbolic, the block region it compiles ("" for the whole model) and why
    it was compiled (the first line of TorchDynamo's reason)."""

    index: int
    seconds: float
    lowering: str
    dynamic: bool
    reason: str
    region: str = ""

    @property
    def variant(self) -> str:
        """'inductor, dynamic shapes': how the graph was lowered, and for which shapes."""
        return f"{self.lowering}, {'dynamic' if self.dynamic else 'static'} shapes"

    def line(self) -> str:
        """'Kiln compiled graph 0 in 34.2s (inductor, dynamic shapes): first compile', with 'for region
        ResnetBlock2D#1' before the colon when the model compiles by blocks."""
        region = f" for region {self.region}" if self.region else ""
        return f"Kiln compiled graph {self.index} in {self.seconds:.1f}s ({self.variant}){region}: {self.reason}"

    def message(self, prompt_id: str, node_id: str) -> dict:
        """The websocket message's data: which prompt and node it belongs to, and the record."""
        return {"prompt_id": prompt_id, "node": node_id, "event": asdict(self)}

    @classmethod
    def from_message(cls, data: dict) -> "CompileEvent":
        """The record in a COMPILE_EVENT message's data; ValueError naming what is missing or wrong."""
        record = data.get("event") if isinstance(data, dict) else None
        if not isinstance(record, dict):
            raise ValueError("a Kiln compile event without its record ('event', a JSON object)")
        values = {}
        for field in fields(cls):
            kind = {"int": int, "float": (int, float), "bool": bool, "str": str}[str(field.type)]
            value = record.get(field.name, "" if field.name == "region" else None)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ValueError(f"a Kiln compile event whose {field.name!r} is {value!r}, not {field.type}")
            values[field.name] = value
        return cls(**values)
