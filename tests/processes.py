"""Watching real processes through Linux's /proc, for the tests that check none is left behind; and busy
neighbours, for the tests of shared cores."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator


def alive(pid: int) -> bool:
    """Some thread of the process still runs (or is still exiting). A zombie runs nothing, and an orphan's
    zombie waits for a reaper that may not exist here; but a killed process's main thread can be a zombie
    while its other threads still exit, and the files they share (and the flocks on them) are closed only
    when the last of them does."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except OSError:
            continue
    return False


def process_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command: state, ppid, pgrp, ...) of every process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    yield int(entry), handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    return {p for p, fields in process_stats() if int(fields[1]) == pid}


def group(pgid: int) -> set[int]:
    """The processes of process group `pgid`."""
    return {p for p, fields in process_stats() if int(fields[2]) == pgid}


def wait_gone(pids: Iterable[int], seconds: float) -> list[int]:
    """Wait up to `seconds` for every process of `pids` to end; those still alive then."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@contextlib.contextmanager
def busy_processes(n: int):
    """n plain busy loops (nice 0) running beside the block, killed after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "x = 0\nwhile True:\n    x += 1\n"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
