"""CpuShare: the cores the engine may use (affinity, cgroup quota) and the thread count it picks from what it
measures (runtime/engine/cpu_share.py), down to the real engine beside busy processes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from runtime.engine import cpu_share
from runtime.engine.cpu_share import CpuLimits, CpuShare, cpu_limits, decide
from runtime.model import decode_layers
from tests.processes import busy_processes


def fake_proc(tmp_path: Path, cgroup_line: str, fstype: str, options: str, mount: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    (proc / "self" / "mountinfo").write_text(
        "22 1 0:20 / /proc rw,nosuid - proc proc rw\n"
        f"30 25 0:26 / {mount} rw,nosuid,nodev,noexec - {fstype} cgroup {options}\n"
    )
    return proc


def test_a_v2_quota_is_the_smallest_along_the_cgroup_path(tmp_path):
    mount = tmp_path / "unified"
    leaf = mount / "kubepods" / "pod1"
    leaf.mkdir(parents=True)
    (mount / "kubepods" / "cpu.max").write_text("300000 100000\n")
    (leaf / "cpu.max").write_text("150000 100000\n")
    (leaf / "cpu.stat").write_text("usage_usec 10\nnr_periods 4\nnr_throttled 3\n")
    proc = fake_proc(tmp_path, "0::/kubepods/pod1", "cgroup2", "rw", mount)
    limits = cpu_limits(proc, tmp_path / "nowhere")
    assert limits.quota == 1.5
    assert limits.cpu_stat == leaf / "cpu.stat"
    assert cpu_share._throttled(limits.cpu_stat) == 3
    assert limits.cores == min(len(os.sched_getaffinity(0)), 2)

    (mount / "kubepods" / "cpu.max").write_text("50000 100000\n")  # the parent's is smaller now
    assert cpu_limits(proc, tmp_path / "nowhere").quota == 0.5
    assert cpu_limits(proc, tmp_path / "nowhere").cores == 1

    for node in (mount / "kubepods", leaf):
        (node / "cpu.max").write_text("max 100000\n")
    assert cpu_limits(proc, tmp_path / "nowhere").quota is None


def test_a_v1_quota_is_read_from_the_cpu_controllers_mount(tmp_path):
    mount = tmp_path / "cpu,cpuacct"
    leaf = mount / "docker" / "abc"
    leaf.mkdir(parents=True)
    (leaf / "cpu.cfs_quota_us").write_text("250000\n")
    (leaf / "cpu.cfs_period_us").write_text("100000\n")
    (mount / "docker" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota above
    (mount / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    proc = fake_proc(tmp_path, "4:cpu,cpuacct:/docker/abc", "cgroup", "rw,cpu,cpuacct", mount)
    limits = cpu_limits(proc, tmp_path / "nowhere")
    assert limits.quota == 2.5
    assert limits.cores == min(len(os.sched_getaffinity(0)), 3)
    (leaf / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limits(proc, tmp_path / "nowhere").quota is None


def test_the_affinity_mask_not_the_machines_cores_bounds_the_threads():
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        limits = cpu_limits()
        assert limits.affinity == 1 and limits.cores == 1
        threads = torch.get_num_threads()
        share = CpuShare(limits=limits)
        assert share.most == share.threads == 1 and torch.get_num_threads() == 1
        assert "1 compute threads" in share.describe()
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "threads, cores, wait, idle, throttled, expected",
    [
        (2, 2, 0.50, 0.0, False, 1),  # two busy processes: 4 runnable on 2 cores
        (2, 2, 0.33, 0.0, False, 1),  # one busy process: 3 runnable on 2 cores
        (2, 2, 0.08, 0.0, False, 2),  # a little of the front end: not worth a thread
        (1, 2, 0.33, 0.0, False, 1),  # one thread among two busy processes stays one
        (1, 2, 0.00, 0.0, False, 1),  # one thread beside one busy process: no core idle
        (1, 2, 0.00, 0.95, False, 2),  # a core stood idle: take it
        (1, 2, 0.10, 0.95, False, 1),  # ... but not while the one thread waits
        (2, 2, 0.00, 0.0, True, 1),  # the quota throttled it
        (4, 4, 0.50, 0.0, False, 1),  # 8 runnable on 4 cores: 4 are others', none left free
        (8, 8, 0.20, 0.0, False, 6),  # 10 runnable on 8: 2 are others'
    ],
)
def test_decide(threads, cores, wait, idle, throttled, expected):
    assert decide(threads, cores, cores, wait, idle, throttled) == expected


def window(share: CpuShare, at: float, wait_share: float, idle_cores: float, throttled: int = 0) -> float:
    """Feed CpuShare one window of synthetic measurements ending at `at`; the next window's start."""
    seconds = cpu_share.WINDOW_SECONDS
    ns = int(seconds * 1e9) * share.threads
    run, wait = int(ns * (1 - wait_share)), int(ns * wait_share)
    jiffies = 100
    mode = (share.threads, share.split)
    last = share._last or (at - seconds, 0, 0, (0, 0, 0), 0, mode)
    _, run0, wait0, (idle0, steal0, total0), thr0, _ = last
    idle = int(jiffies * idle_cores / len(share._cpus))
    sample = (
        at,
        run0 + run,
        wait0 + wait,
        (idle0 + idle, steal0, total0 + jiffies),
        thr0 + throttled,
        mode,
    )
    share._decide(at, (at - seconds, run0, wait0, (idle0, steal0, total0), thr0, mode), sample)
    share._last = sample
    return at + seconds


def test_hysteresis_falls_at_once_rises_after_two_windows_and_backs_off_a_rise_that_fails():
    threads = torch.get_num_threads()
    try:
        share = CpuShare(2, limits=CpuLimits(2, None, None, None))
        share._cpus = {0, 1}
        t = 100.0
        t = window(share, t, 1 / 3, 0.0)  # one busy process: 3 runnable on 2 cores
        assert share.threads == 1 and share.contention == pytest.approx(1 / 3, abs=0.01)
        t = window(share, t, 0.0, 1.0)
        assert share.threads == 1  # one idle window is not enough
        t = window(share, t, 0.0, 1.0)
        assert share.threads == 2 and torch.get_num_threads() == 2
        t = window(share, t, 1 / 3, 0.0)  # the rise proved too many at once
        assert share.threads == 1
        hold = share._hold_until
        assert hold >= t - cpu_share.WINDOW_SECONDS + cpu_share.BACKOFF_SECONDS - 1e-9
        while t < hold:  # idle windows within the back-off do not rise
            t = window(share, t, 0.0, 1.0)
            assert share.threads == 1
        t = window(share, t, 0.0, 1.0)
        t = window(share, t, 0.0, 1.0)
        assert share.threads == 2
        t = window(share, t, 1 / 3, 0.0)  # failed again: the back-off doubled
        assert share._hold_until - t >= 2 * cpu_share.BACKOFF_SECONDS - 2 * cpu_share.WINDOW_SECONDS
        assert not share.split
    finally:
        torch.set_num_threads(threads)


def test_threads_that_get_less_than_a_core_split_the_decode_rows_and_leave_the_split_when_others_go():
    """With two others runnable on two cores one thread gets two thirds of a core; two threads with the rows
    split get half a core each, without barriers. Measured from two shared threads (waiting half their runnable
    time) or from one (a third): split. In the split, the same crowd keeps it; fewer others than
    SPLIT_OTHERS_OUT, or a throttling quota, go back to one thread; one other alone is not worth a split."""
    threads = torch.get_num_threads()
    try:
        share = CpuShare(2, limits=CpuLimits(2, None, None, None))
        share._cpus = {0, 1}
        t = window(share, 100.0, 0.5, 0.0)  # 2 threads, 2 others
        assert share.split and share.threads == 2 and torch.get_num_threads() == 1
        assert len(share._part_tids) == 1 and "split" in share.describe()
        t = window(share, t, 0.5, 0.0)
        assert share.split
        t = window(share, t, 0.1, 0.0)  # 2 / 0.9 - 2: a fifth of another
        assert not share.split and share.threads == 1 and torch.get_num_threads() == 1
        t = window(share, t, 0.0, 0.0)  # one other (no idle core, no wait): one thread
        assert not share.split and share.threads == 1
        t = window(share, t, 1 / 3, 0.0)  # 1 thread among 3 runnable: 2 others
        assert share.split and share.threads == 2
        t = window(share, t, 0.5, 0.0, throttled=1)
        assert not share.split and share.threads == 1
        share = CpuShare(2, limits=CpuLimits(2, 1.5, 0.1, None))  # paced under a quota: never split
        share._cpus = {0, 1}
        window(share, 200.0, 0.5, 0.0)
        assert not share.split and share.threads == 1
    finally:
        decode_layers.set_split(1)
        torch.set_num_threads(threads)


def test_under_a_fractional_quota_each_step_runs_all_threads_only_while_the_quota_has_room():
    threads = torch.get_num_threads()
    try:
        share = CpuShare(2, limits=CpuLimits(2, 1.5, 0.1, None))
        assert share.paced and share.threads == 2 and "paced" in share.describe()
        now = cpu = 0.0
        used = []
        for _ in range(400):  # 4 ms steps, each using step_threads cores
            share._pace(now, cpu)
            used.append(share.step_threads)
            now += 0.004
            cpu += 0.004 * share.step_threads
        rate = cpu / now
        assert set(used) == {1, 2}
        assert rate <= 1.5 * cpu_share.PACE_SHARE + 0.05, rate  # within the quota, with the margin
        assert rate >= 1.5 * cpu_share.PACE_SHARE - 0.1, rate  # ... and spending most of it
        unpaced = CpuShare(2, limits=CpuLimits(2, 2.0, 0.1, None))
        assert not unpaced.paced
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_beside_busy_processes_the_engine_splits_the_decode_rows_and_its_tokens_do_not_change(caplog):
    """As many busy processes as cores: the engine's two threads wait half their time, one thread would get two
    thirds of a core; it splits the decode rows between its threads. The tokens of a batch stay those of one
    thread, and of one prompt those it makes quiet."""
    from runtime import Engine, SamplingParams

    caplog.set_level(logging.DEBUG, logger="prescient.engine")

    threads = torch.get_num_threads()
    try:
        engine = Engine.from_pretrained(kv_cache_bytes=64 << 20, num_threads=2)  # the C layer loop's dtype
        prompt = [engine.tokenizer.encode("Rivers of the world, in order of length:")]
        batch = [engine.tokenizer.encode(f"Item {i} of a list of the tallest mountains:") for i in range(6)]
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        quiet = engine.generate(prompt, greedy)[0].token_ids
        engine.cpu.adaptive = False
        torch.set_num_threads(1)
        one_thread = [o.token_ids for o in engine.generate(batch, greedy)]
        engine.cpu.adaptive = True
        torch.set_num_threads(engine.cpu.step_threads)
        cores = len(os.sched_getaffinity(0))
        with busy_processes(cores):
            deadline = time.monotonic() + 30
            while not engine.stats().cpu_split and time.monotonic() < deadline:
                assert engine.generate(prompt, greedy)[0].token_ids == quiet
            assert engine.stats().cpu_split, engine.cpu.describe()
            assert engine.stats().cpu_threads == 2 and torch.get_num_threads() == 1
            assert [o.token_ids for o in engine.generate(batch, greedy)] == one_thread
            assert engine.generate(prompt, greedy)[0].token_ids == quiet
        # the window that split them: its threads waited
        splits = [r.getMessage() for r in caplog.records if " split (" in r.getMessage()]
        assert splits, [r.getMessage() for r in caplog.records]
        waited = float(splits[0].split("waiting ")[1].split(",")[0])
        assert waited >= cpu_share.WAIT_SHARE_DOWN, splits[0]
        assert "adaptive" in engine.describe()
    finally:
        decode_layers.set_split(1)
        torch.set_num_threads(threads)
