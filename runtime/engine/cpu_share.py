"""CpuShare: how many compute threads the engine runs, from the cores it may use and the share of them it gets.

A server rarely owns its cores: pods share nodes under CPU quotas, CI runners and laptops run other work.
Every kernel splits its work over the compute threads and ends in a barrier, so a step waits for its
slowest thread; a thread the kernel has descheduled for another process's time slice stalls the step, and
its peer spins (burning the slice the neighbours and the stalled thread need). Three measurements decide
how many threads to run:

- The cores it may use: its affinity mask (os.sched_getaffinity), and under a CPU quota of Q cores (cgroup
  v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, the smallest along the cgroup's path) at most
  ceil(Q): the most threads it ever runs.
- Whether its threads wait for a core: each compute thread's scheduler statistics
  (/proc/self/task/TID/schedstat: time run, time runnable but waiting for a core). With T threads runnable
  on C cores, a waiting share w means about C / (1 - w) runnable tasks, so C / (1 - w) - T of them are
  someone else's; a VM's steal time counts as waiting too.
- Whether a core stands idle: the idle time of the cores in its mask (/proc/stat), and under a quota
  whether the cgroup was throttled (cpu.stat's nr_throttled).

Every WINDOW_SECONDS of stepping it decides, with hysteresis:
- fewer threads when they waited for a WAIT_SHARE_DOWN share of their runnable time or the cgroup was
  throttled: as many as the cores the others leave free, at least one. With one thread no barrier waits
  on a descheduled peer and the idle OpenMP workers stop spinning (they sleep after their spin count), so
  the engine spins only while it runs several threads on cores it has measured to be free;
- one more thread when, over a window, its threads did not wait and a core of its mask stood idle for at
  least IDLE_CORE_UP of the window; after a thread count that proved too many (it waited or was throttled
  again within a window or two of rising), not before a back-off that doubles up to BACKOFF_MAX_SECONDS.

Where one thread gets less than a core (others, runnable beside it, outnumber the cores it leaves: at least
SPLIT_OTHERS_IN of them) it runs its threads again but with the rows of each decode step split between them
(runtime/model/decode_layers.py, set_split): each thread takes its rows through every layer and the LM head
alone, each kernel on one thread, so none waits on a descheduled peer; the threads cost each other only a
second read of the weights (decode rows of 16 streams split in two take as long as on two shared threads,
when quiet). Back to one thread once fewer than SPLIT_OTHERS_OUT others are measured, or under a quota that
throttles. A step of one row runs on the stepping thread alone, as with one thread; a step that prefills runs as
two parts of whole sequences, each its own forward on its thread (ModelRunner._prefill_cut).

Under a quota of fewer cores than threads (1.5 cores, 2 threads) it paces each step (CpuShare.paced), and
the core process starts with a short OpenMP spin (runtime/engine/core_client.py).

The choice and the measured contention are in every step's stats (`prescient:cpu_threads`,
`prescient:cpu_contention`) and in the engine's startup line. Without /proc (not Linux) it keeps the most
threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from pathlib import Path

import torch

from runtime.engine.cpu_limits import CpuLimits, cpu_limits
from runtime.kernels.library import load
from runtime.model.decode_layers import set_split

log = logging.getLogger("prescient.engine")

WINDOW_SECONDS = 0.25
"""How often the measurements are read while the engine steps (each read costs ~0.1 ms)."""
BUSY_SHARE_MIN = 0.2
"""A window whose compute threads were runnable for less than this share of it (the engine mostly idle)
decides nothing."""
WAIT_SHARE_DOWN = 0.15
"""Fewer threads once they waited for a core this share of their runnable time."""
WAIT_SHARE_UP = 0.05
"""More threads only while they waited less than this share."""
IDLE_CORE_UP = 0.6
"""More threads only when the cores of the mask stood idle this many core-windows in a window."""
PACE_SHARE = 0.85
"""Under a fractional CPU quota, the CPU time the engine aims to use over each quota period, as a share of
the quota (the rest is the front end's and the margin against throttling)."""
SPLIT_OTHERS_IN = 1.5
"""Split the decode rows over the threads (from one thread or several shared) once this many others are
measured runnable beside them: one thread then gets at most cores / (others + 1) of a core, each of the split
threads cores / (others + threads)."""
SPLIT_OTHERS_OUT = 0.75
"""Leave the split for one thread once fewer others than this are measured."""
BACKOFF_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 60.0
"""After a rise proved too many, the next rise waits BACKOFF_SECONDS, doubling each time up to this."""


def _throttled(stat: Path | None) -> int:
    if stat is None:
        return 0
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "nr_throttled":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cpu_times(cpus: set[int]) -> tuple[int, int, int]:
    """(idle, steal, total) jiffies summed over these CPUs' lines of /proc/stat."""
    idle = steal = total = 0
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read(65536).decode()
    except OSError:
        return 0, 0, 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *values = line.split()
        try:
            cpu = int(name[3:])
        except ValueError:
            break
        if cpu not in cpus:
            continue
        v = [int(x) for x in values[:8]]
        idle += v[3] + v[4]
        steal += v[7] if len(v) > 7 else 0
        total += sum(v)
    return idle, steal, total


def _schedstat(tid: int) -> tuple[int, int] | None:
    """(ns run, ns runnable but waiting) of one of this process's threads."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def others(cores: int, threads: int, wait_share: float) -> float:
    """Runnable tasks not the engine's on its cores, from its threads' waiting share: T threads runnable on C
    cores waiting a share w of their runnable time see about C / (1 - w) runnable tasks."""
    return cores / (1.0 - min(wait_share, 0.95)) - threads


def decide(
    threads: int,
    most: int,
    cores: int,
    wait_share: float,
    idle_cores: float,
    throttled: bool,
) -> int:
    """The thread count for the next window from the last one's measurements (no hysteresis here).

    threads: run in the window; most: the cap; cores: the cores it may use (mask, quota); wait_share: the
    share of the threads' runnable time spent waiting for a core (steal included); idle_cores: core-windows
    the mask's cores stood idle; throttled: the cgroup's quota throttled it in the window."""
    if throttled:
        return max(1, threads - 1)
    if wait_share >= WAIT_SHARE_DOWN and threads > 1:
        return max(1, min(threads - 1, round(cores - others(cores, threads, wait_share))))
    if wait_share < WAIT_SHARE_UP and idle_cores >= IDLE_CORE_UP and threads < most:
        return threads + 1
    return threads


class CpuShare:
    """Chooses the engine's compute thread count while it steps (the module docstring has how)."""

    def __init__(self, most: int | None = None, adaptive: bool = True, limits: CpuLimits | None = None):
        """most: the cap (None: the cores it may use, at most torch's default thread count)."""
        self.limits = limits or cpu_limits()
        self.most = most or max(1, min(self.limits.cores, torch.get_num_threads()))
        self.adaptive = adaptive
        self.threads = self.most
        """The threads it runs, as measured each window (a step under quota pacing may run fewer)."""
        self.contention = 0.0
        """The last window's waiting share of the compute threads' runnable time (steal included)."""
        quota = self.limits.quota
        self.paced = adaptive and quota is not None and quota < self.most
        """Under a quota of fewer cores than threads (1.5 cores, 2 threads): each step runs all the threads
        while the process's CPU time over the quota's last period stays under PACE_SHARE of the quota, and
        floor(quota) threads (at least one) otherwise, so the quota is spent evenly instead of throttled."""
        self._floor = max(1, int(quota)) if self.paced else self.most
        self._budget = PACE_SHARE * quota if self.paced else 0.0
        self._history: deque[tuple[float, float]] = deque()
        self.split = False
        """The decode rows run split over `threads` threads of one kernel thread each (set_split)."""
        self.step_threads = self.threads
        torch.set_num_threads(self.threads)
        self._tids: list[int] | None = None
        self._part_tids: list[int] = []
        self._cpus: set[int] = set()
        self._next = 0.0
        self._last: tuple | None = None
        self._risen_at: float | None = None  # when the last rise happened, until it proves out
        self._backoff = BACKOFF_SECONDS
        self._hold_until = 0.0
        self._streak = 0

    def describe(self) -> str:
        quota = f"{self.limits.quota:g} cores" if self.limits.quota else "none"
        mode = "adaptive" if self.adaptive else "fixed"
        if self.split:
            mode += ", decode rows split between them"
        if self.paced:
            quota += f", paced to {PACE_SHARE:.0%} of it"
        return (
            f"{self.threads} compute threads ({mode}; affinity {self.limits.affinity} cores, quota {quota})"
        )

    def before_step(self) -> None:
        """Called by the stepping thread before each step: reads the measurements once a window and sets
        the thread count for the steps that follow."""
        if not self.adaptive:
            return
        now = time.monotonic()
        if self.paced:
            self._pace(now, time.process_time())
        if now < self._next:
            return
        self._next = now + WINDOW_SECONDS
        if self._tids is None:
            self._start()
            if not self._tids:
                self.adaptive = False
                return
        sample = self._sample(now)
        last, self._last = self._last, sample
        if last is None:
            return
        self._decide(now, last, sample)

    def _pace(self, now: float, cpu: float) -> None:
        """now: monotonic seconds; cpu: the process's CPU seconds (all its threads)."""
        history, period = self._history, self.limits.period or 0.1
        history.append((now, cpu))
        while len(history) > 2 and history[1][0] <= now - period:
            history.popleft()
        then, used = history[0]
        rate = (cpu - used) / (now - then) if now - then >= period / 4 else 0.0
        want = self.threads if rate < self._budget else min(self.threads, self._floor)
        if want != self.step_threads:
            self.step_threads = want
            torch.set_num_threads(want)

    def _start(self) -> None:
        """The stepping thread's own OpenMP pool: its threads' ids, and the step's thread count set for this
        thread (OpenMP keeps it per thread)."""
        torch.set_num_threads(self.step_threads)
        lib = load()
        if lib is None or not Path("/proc/self/task").is_dir():
            self._tids = []
            return
        ids = (ctypes.c_int64 * self.most)()
        n = lib.compute_thread_ids(self.most, ids)
        self._tids = [int(ids[i]) for i in range(n)]
        try:
            self._cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = set(range(os.cpu_count() or 1))

    def _sample(self, now: float) -> tuple:
        run = wait = 0
        tids = self._tids[:1] + self._part_tids if self.split else self._tids[: self.threads]
        for tid in tids:
            got = _schedstat(tid)
            if got is not None:
                run += got[0]
                wait += got[1]
        mode = (self.threads, self.split)
        return now, run, wait, _cpu_times(self._cpus), _throttled(self.limits.cpu_stat), mode

    def _decide(self, now: float, last: tuple, sample: tuple) -> None:
        t0, run0, wait0, (idle0, steal0, total0), thr0, mode0 = last
        t1, run1, wait1, (idle1, steal1, total1), thr1, mode1 = sample
        if mode0 != mode1:  # the window straddled a change: measure the new count afresh
            return
        threads1 = mode1[0]
        seconds = t1 - t0
        run, wait = run1 - run0, wait1 - wait0
        busy = (run + wait) / 1e9 / seconds / threads1 if seconds > 0 else 0.0
        if busy < BUSY_SHARE_MIN:
            return
        jiffies = total1 - total0
        steal = (steal1 - steal0) / jiffies if jiffies > 0 else 0.0
        idle_cores = (idle1 - idle0) / jiffies * len(self._cpus) if jiffies > 0 else 0.0
        self.contention = min(1.0, wait / (run + wait) + steal) if run + wait else steal
        throttled = thr1 > thr0
        crowd = others(self.limits.cores, threads1, self.contention)
        if self.split:
            if throttled or crowd < SPLIT_OTHERS_OUT:
                self._set(1, False, "leave the split", idle_cores)
            return
        if self.most > 1 and not self.paced and not throttled and crowd >= SPLIT_OTHERS_IN:
            if threads1 > 1:  # the rows split over the same threads: not a rise, no back-off
                self._risen_at = None
            self._streak = 0
            self._set(self.most, True, "split the decode rows", idle_cores)
            return
        want = decide(threads1, self.most, self.limits.cores, self.contention, idle_cores, throttled)
        if want < threads1 and self._risen_at is not None and now - self._risen_at < 3 * WINDOW_SECONDS:
            self._hold_until = now + self._backoff  # the rise proved too many: wait longer before the next
            self._backoff = min(2 * self._backoff, BACKOFF_MAX_SECONDS)
        if want > threads1 and now < self._hold_until:
            want = threads1
        if want == threads1:
            self._streak = 0
            if self._risen_at is not None and now - self._risen_at >= 3 * WINDOW_SECONDS:
                self._risen_at = None
                self._backoff = BACKOFF_SECONDS
            return
        self._streak += 1
        if want > threads1 and self._streak < 2:  # rise on two windows in a row; fall on one
            return
        self._streak = 0
        self._risen_at = now if want > threads1 else None
        self._set(want, False, "", idle_cores)

    def _set(self, threads: int, split: bool, why: str, idle_cores: float) -> None:
        log.debug(
            "compute threads %d -> %d%s (waiting %.2f, idle cores %.2f%s)",
            self.threads,
            threads,
            " split" if split else "",
            self.contention,
            idle_cores,
            f": {why}" if why else "",
        )
        self._part_tids = set_split(threads if split else 1)
        self.split = split
        self.threads = threads
        self.step_threads = 1 if split else threads
        torch.set_num_threads(self.step_threads)
