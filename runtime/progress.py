"""A one-line progress display for long operations (model load, benchmarks) on a terminal.

It draws only when its stream is a TTY and logging is not configured (the root logger has no
handler): under the server, in CI, or in a pipe it stays silent, so logs are never interleaved
with carriage returns. `PRESCIENT_PROGRESS=0` turns it off, `=1` forces it on.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import IO


def progress_enabled(stream: IO[str]) -> bool:
    forced = os.environ.get("PRESCIENT_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not logging.getLogger().handlers


class Progress:
    """`with Progress("loading weights", total=n) as p: ... p.update()` draws `label: k/n (pct) t s`."""

    def __init__(
        self, label: str, total: int | None = None, stream: IO[str] | None = None, min_interval: float = 0.1
    ):
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = progress_enabled(self.stream)
        self.min_interval = min_interval
        self.started = time.monotonic()
        self.last_draw = 0.0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last_draw >= self.min_interval or self.done == self.total):
            self.last_draw = now
            self._draw(note)

    def _draw(self, note: str = "", end: str = "") -> None:
        count = f"{self.done}/{self.total} ({self.done / self.total:.0%})" if self.total else str(self.done)
        line = f"{self.label}: {count} {time.monotonic() - self.started:.1f} s" + (f" {note}" if note else "")
        self.stream.write("\r\x1b[2K" + line + end)
        self.stream.flush()

    def ticking(self, every: float = 1.0) -> Progress:
        """Redraw (elapsed time) every `every` seconds until closed: for work that reports no steps."""
        if self.enabled:
            self._stop = threading.Event()

            def tick():
                while not self._stop.wait(every):
                    self._draw()

            self._ticker = threading.Thread(target=tick, daemon=True, name="progress")
            self._ticker.start()
        return self

    def close(self, keep: bool = True) -> None:
        """End the line (keep=True) or erase it (so that what is printed next starts clean)."""
        if getattr(self, "_ticker", None) is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
        if self.enabled:
            if keep:
                self._draw(end="\n")
            else:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
