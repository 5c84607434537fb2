"""Reclaim what a killed loader left behind: shared-memory segments and disk-tier directories.

Every segment and directory a loader makes carries its owner's pid in its name
(`prescient_<pid>_<random>` in /dev/shm, `prescient-<pid>-<random>` under cache_disk). A
clean exit, an exception or garbage collection removes them, and the resource tracker
unlinks a segment when the owner is SIGKILLed; only a killed tracker (OOM killer, a killed
process group) or a SIGKILLed disk tier leaves something behind. The next loader to start
on the node removes those whose owner pid no longer runs.
"""

from __future__ import annotations

import os
import re
import shutil

SHM_DIR = "/dev/shm"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stale(names: list[str], pattern: re.Pattern) -> list[str]:
    out = []
    for name in names:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            out.append(name)
    return out


def reclaim_shared_memory(prefix: str) -> list[str]:
    """Unlink /dev/shm segments named `<prefix><pid>_...` whose pid is gone; the names removed."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in _stale(names, re.compile(re.escape(prefix) + r"(\d+)_[0-9a-f]+")):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:  # its tracker got there first, or not ours to remove
            pass
    return removed


def reclaim_directories(root: str, prefix: str) -> list[str]:
    """Remove directories under `root` named `<prefix><pid>-...` whose pid is gone; the paths removed."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in _stale(names, re.compile(re.escape(prefix) + r"(\d+)-.+")):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
