"""What `kiln queue` prints and writes for each prompt: one line as it finishes, a table after a sweep,
and the same records as JSON (--json)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    """One queued prompt, as reported. Times are seconds; None where unknown (a failed prompt, or the
    queue/run split when the websocket was not available)."""
    index: int
    settings: dict  # the swept inputs, "NODE.INPUT" -> value
    status: str = "ok"  # ok | rejected | failed | timed out
    error: str = ""
    prompt_id: str = ""
    queue_seconds: float | None = None
    run_seconds: float | None = None
    total_seconds: float | None = None
    uses_kiln: bool = False
    kiln_compile_seconds: float | None = None
    kiln_variants: list = field(default_factory=list)
    kiln_lines: list = field(default_factory=list)
    kiln_compiles: list = field(default_factory=list)  # {"node": title (id), "event": a CompileEvent's fields}
    images: list = field(default_factory=list)  # downloaded paths, or the server's file names
    downloaded: bool = False
    images_not_downloaded: int = 0  # with --out, past queue.MAX_IMAGES_PER_PROMPT: counted, not downloaded
    left_out: dict = field(default_factory=dict)  # what the server sent past kiln's caps (follow.py) -> how many
    nothing_ran: bool = False  # ComfyUI's cache had every output

    def as_json(self) -> dict:
        record = asdict(self)
        for key in ("queue_seconds", "run_seconds", "total_seconds", "kiln_compile_seconds"):
            if record[key] is not None:
                record[key] = round(record[key], 3)
        return record


def prompt_line(result: Result, count: int) -> str:
    """'prompt 3/8 [5.seed=2]: queued 0.1s, ran 12.3s, Kiln compile 34.2s (inductor, dynamic shapes),
    2 image(s) -> out/a.png, out/b.png', then Kiln's lines for it, indented."""
    head = f"prompt {result.index}/{count}"
    if result.settings:
        head += " [" + ", ".join(f"{key}={value}" for key, value in result.settings.items()) + "]"
    if result.status != "ok":
        return f"{head}: {result.status.upper()}: {result.error}"
    if result.queue_seconds is not None and result.run_seconds is not None:
        parts = [f"queued {result.queue_seconds:.1f}s", f"ran {result.run_seconds:.1f}s"]
    else:
        parts = [f"took {result.total_seconds:.1f}s in all"]
    if result.uses_kiln:
        variants = f" ({'; '.join(result.kiln_variants)})" if result.kiln_variants else ""
        if result.kiln_compile_seconds is None:
            parts.append("Kiln compile not known (no websocket)")
        elif result.kiln_compile_seconds:
            parts.append(f"Kiln compile {result.kiln_compile_seconds:.1f}s{variants}")
        else:
            parts.append("Kiln compiled nothing")
    parts.append(f"{len(result.images)} image(s)" + (f" -> {', '.join(result.images)}" if result.downloaded and
                                                      result.images else ""))
    if result.images_not_downloaded:
        parts.append(f"{result.images_not_downloaded} more image(s) NOT downloaded (kiln queue downloads at most "
                     f"{len(result.images)} per prompt)")
    if result.nothing_ran:
        parts.append("nothing ran (ComfyUI's cache had every output)")
    left_out = [f"  left out: {count} {what}" for what, count in result.left_out.items()]
    return "\n".join([f"{head}: {', '.join(parts)}"] + [f"  {line}" for line in result.kiln_lines] + left_out)


def sweep_table(results: list[Result]) -> str:
    """An aligned table of the prompts (swept inputs, queue s, run s, Kiln compile s, images, result)
    and a totals row."""
    keys = list(dict.fromkeys(key for result in results for key in result.settings))
    header = ["#", *keys, "queue s", "run s", "kiln compile s", "images", "result"]
    rows = []
    for r in results:
        run = r.run_seconds if r.run_seconds is not None else r.total_seconds
        rows.append([str(r.index), *(str(r.settings.get(key, "")) for key in keys), _seconds(r.queue_seconds),
                     _seconds(run), _seconds(r.kiln_compile_seconds) if r.uses_kiln else "-",
                     str(len(r.images)) if r.status == "ok" else "", r.status])
    ok = [r for r in results if r.status == "ok"]
    failed = len(results) - len(ok)
    totals = ["total", *("" for _ in keys),
              _seconds(sum(r.queue_seconds or 0 for r in ok)),
              _seconds(sum((r.run_seconds if r.run_seconds is not None else r.total_seconds) or 0 for r in ok)),
              _seconds(sum(r.kiln_compile_seconds or 0 for r in ok)) if any(r.uses_kiln for r in results) else "-",
              str(sum(len(r.images) for r in ok)), f"{len(ok)} ok" + (f", {failed} failed" if failed else "")]
    return _aligned([header, *rows, totals], numeric=set(range(len(keys) + 1, len(header) - 1)))


def _seconds(value) -> str:
    return "" if value is None else f"{value:.1f}"


def _aligned(rows: list[list[str]], numeric: set) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows)
