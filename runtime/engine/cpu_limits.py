"""The cores this process may use: its affinity mask (os.sched_getaffinity) and its cgroup's CPU quota (v2
cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, the smallest along the cgroup's path). CpuShare
(runtime/engine/cpu_share.py) runs at most that many compute threads; the server's front end reads it too,
before the engine core starts."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuLimits:
    """The cores this process may run on."""

    affinity: int
    """Cores in its affinity mask."""
    quota: float | None
    """Its cgroup's CPU quota in cores (None: none)."""
    period: float | None
    """The quota's period in seconds (None: no quota)."""
    cpu_stat: Path | None
    """Its cgroup's cpu.stat, whose nr_throttled counts the quota periods it was throttled in (None: none)."""

    @property
    def cores(self) -> int:
        """The most threads worth running: the mask's cores, at most ceil(quota)."""
        return max(1, min(self.affinity, math.ceil(self.quota))) if self.quota else self.affinity


def cpu_limits(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> CpuLimits:
    """This process's affinity mask and cgroup CPU quota (v2 cpu.max, or v1 cfs quota and period)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota, period, stat = None, None, None
    for controllers, path in _cgroups(proc / "self" / "cgroup"):
        if controllers == "":  # cgroup v2: the unified hierarchy
            base = _mount(proc, "cgroup2", None) or cgroup_root
            found = _along(base, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            base = _mount(proc, "cgroup", "cpu") or cgroup_root / controllers
            found = _along(base, path, _v1_quota)
        else:
            continue
        if found is not None:
            (q, p), s = found
            if quota is None or q < quota:
                quota, period, stat = q, p, s
    return CpuLimits(affinity, quota, period, stat)


def _cgroups(path: Path) -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/self/cgroup."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2]))
    return out


def _mount(proc: Path, fstype: str, option: str | None) -> Path | None:
    """Where /proc/self/mountinfo says a cgroup hierarchy of this type (and controller) is mounted."""
    try:
        lines = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != fstype:
            continue
        if option is None or option in tail[2].split(","):
            return Path(fields[4])
    return None


def _along(base: Path, path: str, read) -> tuple[tuple[float, float], Path | None] | None:
    """The smallest quota from the cgroup up to the hierarchy's root, and the cgroup's own cpu.stat."""
    own = base / path.lstrip("/")
    if not own.is_dir():  # a namespaced view: the cgroup is the mount's root
        own = base
    smallest = None
    node = own
    while True:
        q = read(node)
        if q is not None and (smallest is None or q[0] < smallest[0]):
            smallest = q
        if node == base or node.parent == node:
            break
        node = node.parent
    if smallest is None:
        return None
    stat = own / "cpu.stat"
    return smallest, stat if stat.exists() else None


def _v2_quota(node: Path) -> tuple[float, float] | None:
    """(cores, period seconds) of cpu.max, or None for "max"."""
    try:
        quota, _, period = (node / "cpu.max").read_text().strip().partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period), int(period) / 1e6
    except (OSError, ValueError):
        return None


def _v1_quota(node: Path) -> tuple[float, float] | None:
    """(cores, period seconds) of cpu.cfs_quota_us and cpu.cfs_period_us, or None for -1."""
    try:
        quota = int((node / "cpu.cfs_quota_us").read_text())
        period = int((node / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return (quota / period, period / 1e6) if quota > 0 and period > 0 else None
