"""404s in the log: each path once, at most a few lines a minute, so a scanner cannot flood the log."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from server.schema.schema_check import for_log

log = logging.getLogger("prescient.server")

MAX_PATHS = 1024
"""Distinct paths remembered as already logged (the least recent forgotten)."""
LINES_PER_MINUTE = 10


class NotFoundLog:
    def __init__(self, max_paths: int = MAX_PATHS, per_minute: int = LINES_PER_MINUTE, clock=time.monotonic):
        self.max_paths = max_paths
        self.per_minute = per_minute
        self.clock = clock
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._window = clock()
        self._lines = 0
        self._unlogged = 0
        """404s of new paths not logged since the last line (over the rate)."""

    def record(self, method: str, path: str) -> None:
        """A 404 on `path`: logged at WARNING the first time, within the rate."""
        if path in self._seen:
            self._seen.move_to_end(path)
            return
        now = self.clock()
        if now - self._window >= 60:
            self._window, self._lines = now, 0
        if self._lines >= self.per_minute:
            self._unlogged += 1
            return
        self._seen[path] = None
        if len(self._seen) > self.max_paths:
            self._seen.popitem(last=False)
        self._lines += 1
        more = f" ({self._unlogged} more 404s on new paths were not logged)" if self._unlogged else ""
        self._unlogged = 0
        log.warning("404: no route %s %s%s", method, for_log(path), more)
