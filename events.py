"""What Kiln tells a watcher as it compiles: typed records with one JSON form, standard library only.

The compiler makes a `CompileEvent` for each graph it compiles (`GraphCompile.event()`,
compiler/stats.py); ComfyUI's Kiln nodes show its `line()` on themselves (progress text) and send
the record itself as a websocket message of type COMPILE_EVENT (nodes/plan_wrapper.py); `kiln
queue` decodes that message with `CompileEvent.from_message` (client/follow.py) and adds up the
compile time from the records, never from the shown text. While a compile or a quantization runs,
its progress goes the same way as a `WorkProgress` (WORK_PROGRESS), which `kiln queue` shows in
its progress line. Neither side needs torch to read them.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

COMPILE_EVENT = "kiln.compile"  # the websocket message's type
WORK_PROGRESS = "kiln.progress"  # a compile or quantization under way

_KINDS = {"int": int, "float": (int, float), "bool": bool, "str": str}


class _Record:
    """What both records share: the websocket message's data they travel in, and reading it back
    with every field checked. NAME says which record it is in an error."""

    NAME = "record"

    def message(self, prompt_id: str, node_id: str) -> dict:
        """The websocket message's data: which prompt and node it belongs to, and the record."""
        return {"prompt_id": prompt_id, "node": node_id, "event": asdict(self)}

    @classmethod
    def from_message(cls, data: dict):
        """The record in a message's data ({"event": {...}}); ValueError naming the field that is
        missing or of the wrong type ('a Kiln compile event whose 'seconds' is '1.5', not float')."""
        record = data.get("event") if isinstance(data, dict) else None
        if not isinstance(record, dict):
            raise ValueError(f"a Kiln {cls.NAME} without its record ('event', a JSON object)")
        values = {}
        for field in fields(cls):
            kind = _KINDS[str(field.type)]
            value = record.get(field.name, None if field.default is MISSING else field.default)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ValueError(f"a Kiln {cls.NAME} whose {field.name!r} is {value!r}, not {field.type}")
            values[field.name] = value
        return cls(**values)


@dataclass(frozen=True)
class CompileEvent(_Record):
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

    NAME = "compile event"

    @property
    def variant(self) -> str:
        """'inductor, dynamic shapes': how the graph was lowered, and for which shapes."""
        return f"{self.lowering}, {'dynamic' if self.dynamic else 'static'} shapes"

    def line(self) -> str:
        """'Kiln compiled graph 0 in 34.2s (inductor, dynamic shapes): first compile', with 'for region
        ResnetBlock2D#1' before the colon when the model compiles by blocks."""
        region = f" for region {self.region}" if self.region else ""
        return f"Kiln compiled graph {self.index} in {self.seconds:.1f}s ({self.variant}){region}: {self.reason}"


@dataclass(frozen=True)
class WorkProgress(_Record):
    """How far one of Kiln's long jobs is: the job ("compile", "quantize"), what it does now
    ('region 3/11 ResBlock#2: pass fuse_geglu'), and how many of its parts (regions, passes,
    layers) are done of how many."""

    work: str
    what: str
    done: int
    total: int

    NAME = "progress event"

    def line(self) -> str:
        """'Kiln compile 3/11: region 4/11 ResBlock#2: pass fuse_geglu'."""
        return f"Kiln {self.work} {self.done}/{self.total}: {self.what}"
