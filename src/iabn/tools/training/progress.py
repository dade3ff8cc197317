"""A dependency-free progress line on stderr: rewritten in place on a terminal, cut to the
terminal's width so it never wraps (a wrapped line cannot be rewritten and floods the screen);
one full line per update otherwise (log files and CI stay readable)."""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

BAR_WIDTH = 20


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#####-----]`` for ``done`` of ``total``."""
    filled = width * done // total if total else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class ProgressLine:
    """Shows one status line; ``enabled=False`` makes every call a no-op (other ranks)."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.in_place = enabled and self.stream.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        if self.in_place:
            # one column short of the width: writing the last column wraps on some terminals
            columns = max(10, shutil.get_terminal_size().columns - 1)
            if len(text) > columns:
                text = text[:columns - 3] + "..."
            # Pad with spaces so a shorter line fully covers the previous one.
            self.width = min(self.width, columns)
            self.stream.write("\r" + text.ljust(self.width))
            self.width = max(self.width, len(text))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        """Finish an in-place line so the next output starts on a fresh one."""
        if self.in_place and self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0


__all__ = ["ProgressLine", "bar"]
