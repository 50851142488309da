"""What `kiln queue` shows on stderr while a prompt runs: on a terminal one line redrawn in place
('prompt 2/4  KSampler (3)  [#######-------------]  7/20'); otherwise (a log, a pipe) plain lines: each
node as it starts and each progress bar when it completes. Kiln's progress text goes on lines of its own."""
from __future__ import annotations

import shutil
import sys

WIDTH = 24


class ProgressBar:
    def __init__(self, label: str, stream=None):
        self.stream = stream or sys.stderr
        self.label = label
        self.tty = self.stream.isatty()
        self.drawn = False

    def node(self, node_id: str, title: str) -> None:
        if self.tty:
            self._draw(f"{self.label}  {title}")
        else:
            self._line(f"{self.label}  {title}")

    def step(self, node_id: str, title: str, value: int, maximum: int) -> None:
        if self.tty:
            filled = _filled(value, maximum)
            self._draw(f"{self.label}  {title}  [{'#' * filled}{'-' * (WIDTH - filled)}]  {value}/{maximum}")
        elif maximum and value >= maximum:
            self._line(f"{self.label}  {title}  {value}/{maximum}")

    def work(self, text: str) -> None:
        """What one of Kiln's long jobs does now ('Kiln compile 3/11: region 4/11 ResBlock#2: pass
        fuse_geglu'): on a terminal it takes the line until the next step; elsewhere the lines Kiln's
        nodes show already say what was compiled."""
        if self.tty:
            self._draw(f"{self.label}  {text}")

    def note(self, text: str) -> None:
        """A line that stays (Kiln's progress text)."""
        self._line(f"{self.label}  {text}")

    def done(self) -> None:
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn = False

    def _draw(self, text: str) -> None:
        columns = shutil.get_terminal_size().columns
        self.stream.write("\r\033[K" + text[: columns - 1])  # a wrapped line could not be redrawn in place
        self.stream.flush()
        self.drawn = True

    def _line(self, text: str) -> None:
        self.done()
        self.stream.write(text + "\n")
        self.stream.flush()


def _filled(value: float, maximum: float) -> int:
    """How many of the bar's WIDTH cells `value` of `maximum` fills, 0 to WIDTH whatever the numbers
    (the server sends them: value / maximum is only taken below 1, where it cannot overflow)."""
    if maximum <= 0 or value <= 0:
        return 0
    return WIDTH if value >= maximum else int(WIDTH * (value / maximum))
