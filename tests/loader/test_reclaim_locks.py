"""Leftovers are judged by their owner's lock, not by a pid: a loader in another PID namespace
(another container on the node, here `unshare -p`) or on another node sharing cache_disk
starts beside a live loader and leaves its segment and directory alone; what a SIGKILLed
loader left (its resource tracker killed with it) and what nobody locks, whatever pid its
name carries, is still removed by the next loader."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from loader import DataLoader, FileDataset
from loader.cache.reclaim import OWNER_FILE
from tests.loader.conftest import same
from tests.processes import group, wait_gone

pytestmark = pytest.mark.slow  # starts loaders in fresh processes


def head(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)


START_LOADER = textwrap.dedent("""
    import sys, time
    from loader import DataLoader, FileDataset
    dl = DataLoader(FileDataset(sys.argv[1]), batch_size=4, cache_ram="1MiB", cache_disk=sys.argv[2],
                    cache_disk_bytes="1MiB", num_workers=int(sys.argv[3]))
    it = iter(dl)
    next(it)
    print("SEGMENT", dl._engine.shared.name, flush=True)
    if sys.argv[4] == "wait":
        time.sleep(600)
    dl.close()
""")


def lock_freed(path, seconds: float) -> bool:
    """Wait up to `seconds` until nobody holds the flock on `path` (the kernel drops a killed process's locks
    only when its last thread has exited)."""
    deadline = time.monotonic() + seconds
    with open(path, "rb") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
                continue
            fcntl.flock(handle, fcntl.LOCK_UN)
            return True


def start_loader(files, disk, workers: int, then: str, pid_namespace: bool = False) -> subprocess.Popen:
    command = [sys.executable, "-c", START_LOADER, files, str(disk), str(workers), then]
    if pid_namespace:
        command = ["unshare", "--pid", "--fork", *command]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, cwd=os.getcwd(), start_new_session=True, env=os.environ
    )


def cached_loader(files, disk, **settings) -> DataLoader:
    """This process's loader, with the RAM and the disk tier (under `disk`) that a leftover could hit."""
    return DataLoader(
        FileDataset(files, decode=head),
        batch_size=4,
        cache_ram="1MiB",
        cache_disk=str(disk),
        cache_disk_bytes="1MiB",
        **settings,
    )


def needs_pid_namespace() -> None:
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare --pid (root) to start a loader in another PID namespace")


def test_a_loader_in_another_pid_namespace_leaves_a_live_loaders_files(files, tmp_path):
    needs_pid_namespace()
    disk = tmp_path / "disk"
    expected = list(DataLoader(FileDataset(files, decode=head), batch_size=4))
    dl = cached_loader(files, disk, num_workers=2)
    it = iter(dl)
    batches = [next(it)]
    segment = f"/dev/shm/{dl._engine.shared.name}"
    (directory,) = [disk / name for name in os.listdir(disk)]
    assert os.path.exists(segment)
    # our pid means nothing in its namespace: judged by pid, our files would look abandoned
    other = start_loader(files, disk, 0, "exit", pid_namespace=True)
    out = other.communicate(timeout=120)[0]
    assert other.returncode == 0, out
    assert os.path.exists(segment), "a live loader's segment was removed from another PID namespace"
    assert directory.is_dir(), "a live loader's cache_disk directory was removed"
    batches += list(it)
    assert same(batches, expected), "the live loader's batches changed"
    dl.close()
    assert not os.path.exists(segment) and not directory.exists()


def test_a_killed_loaders_files_and_unlocked_ones_are_reclaimed(files, tmp_path):
    disk = tmp_path / "disk"
    victim = start_loader(files, disk, 2, "wait")
    line = victim.stdout.readline()
    assert line.startswith("SEGMENT"), line
    segment = f"/dev/shm/{line.split()[1]}"
    os.killpg(victim.pid, signal.SIGKILL)  # the loader, its workers and its resource tracker
    victim.wait(timeout=60)
    # the workers close their files (and let go of their locks) only as the kernel tears them down, which can
    # come after the leader has been reaped
    assert not wait_gone(group(victim.pid), 60)
    # the segment is in the node-wide /dev/shm: a loader that another test starts now may reclaim it first,
    # which is the behaviour under test too; the disk tier is this test's alone
    (left_behind,) = os.listdir(disk)
    assert lock_freed(disk / left_behind / OWNER_FILE, 60), "the killed loader's directory is still locked"
    # a leftover whose name carries a live pid (ours): a loader of another namespace left it unlocked
    orphan = f"/dev/shm/prescient_{os.getpid()}_00112233aabb"
    with open(orphan, "wb") as handle:
        handle.write(b"x" * 4096)
    orphan_dir = disk / f"prescient-{os.getpid()}-orphan"
    orphan_dir.mkdir()
    (orphan_dir / "3").write_bytes(b"sample")
    dl = cached_loader(files, disk)
    torch_loader = DataLoader(FileDataset(files, decode=head), batch_size=4)
    assert same(list(dl), list(torch_loader))
    assert not os.path.exists(segment) and not os.path.exists(orphan)
    mine = f"prescient-{os.getpid()}-"
    left = [name for name in os.listdir(disk) if not (name.startswith(mine) and name != orphan_dir.name)]
    assert left == [] and not orphan_dir.exists()
    dl.close()
    torch_loader.close()
