"""Transient storage errors: a read that fails with an OSError (a network file system
timing out, an object store resetting the connection) is tried again after a growing
pause before the sample is declared unreadable.

Only OSError is retried: it is what storage raises for a failure that may pass. Anything
else (a ValueError from the dataset's own code, a missing attribute) fails at once, since
asking again would give the same answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3  # reads tried per sample, the first included
    base_delay: float = 0.05  # seconds before the second try; doubled before each further one

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` failed tries (1, 2, ...)."""
        return self.base_delay * (2 ** (failures - 1))

    def call(self, read: Callable[[], bytes]) -> tuple[bytes, int]:
        """read() until it succeeds or the attempts are spent (then its last error is raised).
        Returns the bytes and how many tries failed first."""
        failures = 0
        while True:
            try:
                return read(), failures
            except OSError:
                failures += 1
                if failures >= self.attempts:
                    raise
                time.sleep(self.delay(failures))


def check_retry_options(attempts, base_delay) -> RetryPolicy:
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise ValueError(f"read_attempts: expected an int >= 1 (1 = no retry), got {attempts!r}")
    if isinstance(base_delay, bool) or not isinstance(base_delay, (int, float)) or not base_delay >= 0:
        raise ValueError(f"read_retry_delay: expected seconds >= 0 (a number), got {base_delay!r}")
    return RetryPolicy(attempts, float(base_delay))
