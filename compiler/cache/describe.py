"""What a cache directory holds, in a few lines (the Cache Graph node's report, `kiln cache info`)."""
from __future__ import annotations

from dataclasses import dataclass

from .options import CacheOptions
from .trust import CacheError


@dataclass(frozen=True)
class CacheReport:
    """A cache directory described: `text` for people; `problem`, why it cannot be used ("" if it can)."""

    text: str
    problem: str = ""


def cache_problem(options: CacheOptions) -> str:
    """Why this cache cannot be used ("" if it can, or if it is off). Opening it checks where it is
    and whether it can be trusted, and makes it if missing."""
    if options.mode == "off":
        return ""
    try:
        options.open()
    except (CacheError, OSError) as exc:
        return str(exc)
    return ""


def describe_cache(options: CacheOptions, model: str = "") -> CacheReport:
    """'Kiln's cache (use) at DIR: 3 entries, 21.4 MiB of 20 GiB; 2 for UNetModel.' Opening a cache
    checks where it is and its trust; a problem is described, not raised (the model then compiles
    without it)."""
    if options.mode == "off":
        return CacheReport("Kiln's cache is off: nothing is read or stored.")
    try:
        store = options.open()
        count = total = graphs = records = 0
        seconds = 0.0
        for _, entry, _ in store.headers():  # counted as read: no header is kept
            if entry is None:
                continue
            count, total = count + 1, total + entry.size
            if model and str(entry.fields.get("label", "")).split(" ")[0] == model:
                if "graph" in entry.fields:
                    graphs, seconds = graphs + 1, seconds + entry.compile_seconds
                else:  # a record: a region's choice
                    records += 1
    except (CacheError, OSError) as exc:
        return CacheReport(f"Kiln's cache at {options.named} cannot be used: {exc}. Models compile without it.", str(exc))
    text = (f"Kiln's cache ({options.mode}) at {store.root}: {count} entries, {total / 2**20:.1f} MiB "
            f"of {options.max_gb:g} GiB")
    if model:
        text += f"; {graphs} for {model}"
        if graphs:
            text += f" ({seconds:.0f}s of compiling stored)"
        if records:
            text += f" and {records} region choice(s) (measured, or nothing to fuse)"
    return CacheReport(text + ".")
