"""Clean shutdown, in real processes: an iterator dropped mid-epoch stops its workers at once; a
program that exits mid-epoch exits (no hang) and leaves no worker behind; a main process killed
with SIGKILL leaves no orphan worker for long."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from loader import DataLoader, FileDataset
from tests.loader.conftest import write_files
from tests.processes import alive, wait_gone

pytestmark = pytest.mark.slow  # training programs, each a process (forked by zygote.py)

PROGRAM = """
import sys, time
from loader import DataLoader, FileDataset
dataset = FileDataset(sys.argv[1])
dl = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, cache_ram="1MiB",
                persistent_workers=sys.argv[2] == "persistent")
it = iter(dl)
next(it)
print(" ".join(str(w.pid) for w in it.workers), flush=True)
if sys.argv[3] == "wait":
    time.sleep(60)
"""

# Samples that are not tensors go through the result queue's pipe (64 KiB): with a deep prefetch, the
# worker's queue thread is left blocked on a full pipe when the main process dies.
PROGRAM_PIPE_FULL = """
import time
from loader import DataLoader
class Big:
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return bytes(300_000)
dl = DataLoader(Big(), batch_size=2, num_workers=1, prefetch_factor=8, persistent_workers=True)
it = iter(dl)
next(it)
print(" ".join(str(w.pid) for w in it.workers), flush=True)
time.sleep(60)
"""


def test_dropped_iterator_stops_its_workers(tmp_path):
    dl = DataLoader(FileDataset(write_files(tmp_path, 40)), batch_size=4, num_workers=2, cache_ram="1MiB")
    it = iter(dl)
    next(it)
    pids = [w.pid for w in it.workers]
    assert all(alive(p) for p in pids)
    del it
    gc.collect()
    assert wait_gone(pids, 1.0) == []
    assert len(list(dl)) == 10  # the loader still works
    dl.close()


@pytest.mark.parametrize("persistent", ["persistent", "not_persistent"])
def test_program_exiting_mid_epoch_exits_and_leaves_no_worker(tmp_path, programs, persistent):
    root = write_files(tmp_path, 40)
    program = programs.start(PROGRAM, root, persistent, "exit")
    try:
        stdout, stderr = program.communicate(timeout=60)
    finally:
        program.close()
    assert program.returncode == 0, stderr
    pids = [int(p) for p in stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, 5.0) == []


@pytest.mark.parametrize("results", ["cached_files", "full_pipe"])
def test_main_process_killed_leaves_no_orphan_worker(tmp_path, programs, results):
    if results == "cached_files":
        main = programs.start(PROGRAM, write_files(tmp_path, 40), "persistent", "wait")
    else:
        main = programs.start(PROGRAM_PIPE_FULL)
    try:
        pids = [int(p) for p in main.stdout.readline().split()]
        assert len(pids) == (2 if results == "cached_files" else 1) and all(alive(p) for p in pids)
        time.sleep(1.0)  # the workers fill what they may before the kill
    finally:
        main.send_signal(signal.SIGKILL)
        main.wait(timeout=10)
        main.close()
    left = wait_gone(pids, 10.0)
    for pid in left:  # not left behind on this machine when the test fails
        os.kill(pid, signal.SIGKILL)
    assert left == [], "workers outlived their main process"
