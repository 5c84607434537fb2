"""Budgets hold at every step, and shared memory is gone once the loader and its workers
are: after close(), after garbage collection, after an exception, after SIGKILL."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from loader import DataLoader, FileDataset
from loader.cache.ram import Layout, SharedMemoryFull, SharedState
from tests.loader.conftest import noisy_decode, shm_names, shuffled, write_files
from tests.processes import alive, children


def disk_usage(directory: str) -> int:
    total = 0
    for base, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(base, name))
            except FileNotFoundError:
                pass
    return total


@pytest.mark.parametrize("workers", [0, 2])
def test_budgets_are_never_exceeded(tmp_path, workers):
    sizes = lambda i: 40 + (i * 37) % 200  # noqa: E731 - uneven samples
    dataset = FileDataset(write_files(tmp_path / "data", 80, size=sizes), decode=noisy_decode)
    ram, disk, staging = 2000, 3000, 900
    dl = shuffled(
        dataset,
        4,
        seed=2,
        num_workers=workers,
        cache_ram=ram,
        cache_disk=str(tmp_path / "disk"),
        cache_disk_bytes=disk,
        prefetch_bytes=staging,
    )
    disk_dir = None
    for _ in range(3):
        for _ in dl:
            stats = dl.stats()
            disk_dir = disk_dir or dl._engine.prefetcher.disk.dir
            assert stats["cache_ram_bytes"] <= ram and stats["cache_disk_bytes"] <= disk
            assert disk_usage(disk_dir) <= disk
    stats = dl.stats()
    segment = os.path.getsize(f"/dev/shm/{dl._engine.shared.name}")
    dl.close()
    assert stats["cache_ram_peak_bytes"] <= ram and stats["cache_disk_peak_bytes"] <= disk
    assert stats["cache_ram_peak_bytes"] > ram * 0.8 and stats["disk_hits"] > 0  # the tiers were used
    assert stats["shared_memory_bytes"] == ram + staging
    assert segment < ram + staging + (4 << 20)  # data area plus control block and rings
    assert not os.path.exists(disk_dir)


def test_released_on_close_and_on_garbage_collection(files):
    dataset = FileDataset(files, decode=noisy_decode)
    dl = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True, cache_ram="1MiB")
    next(iter(dl))
    name = dl._engine.shared.name
    assert name in shm_names(os.getpid())
    dl.close()
    assert name not in shm_names(os.getpid())
    dl = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True, cache_ram="1MiB")
    for _ in dl:
        pass
    name = dl._engine.shared.name
    del dl
    gc.collect()
    assert name not in shm_names(os.getpid())


SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from torch.utils.data import get_worker_info
    from loader import DataLoader, FileDataset
    root, disk, ending = sys.argv[1:4]

    class Storage(FileDataset):
        def nbytes(self, index):       # asked by the prefetcher (main process) as it publishes positions
            if ending == "hang" and index >= 12 and get_worker_info() is None:
                time.sleep(600)        # storage hangs: the workers wait on the prefetcher for good
            return super().nbytes(index)

    decode = lambda raw: torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)
    dl = DataLoader(Storage(root, decode=decode), batch_size=2, num_workers=2, persistent_workers=True,
                    cache_ram="1MiB", cache_disk=disk, cache_disk_bytes="1MiB", prefetch_threads=2)
    for step, batch in enumerate(dl):
        if step == 3:
            print("iterating", flush=True)
            if ending == "raise":
                sys.stdin.readline()   # the test has looked at the segment and the disk tier
                raise ValueError("the training step failed")
            if ending == "sigkill":
                time.sleep(600)
""")


@pytest.mark.slow  # training programs, each a process (forked by zygote.py)
@pytest.mark.parametrize("ending", ["raise", "sigkill", "hang"])
def test_released_when_the_process_dies(files, tmp_path, programs, ending):
    """SIGKILL of the main process: its workers exit within seconds (idle in torch's loop, or waiting
    on a position the dead prefetcher will never publish), the resource tracker unlinks the segment,
    and the next loader on the node removes the disk tier's directory."""
    disk = str(tmp_path / "disk")
    process = programs.start(SCRIPT, files, disk, ending)
    try:
        released_when_the_process_dies(files, disk, ending, process)
    finally:
        process.close()


def released_when_the_process_dies(files, disk, ending, process):
    assert process.stdout.readline().strip() == "iterating", process.communicate(timeout=60)
    pid = process.pid
    assert shm_names(pid), "the loader should hold a segment while it runs"
    assert [name for name in os.listdir(disk) if name.startswith(f"prescient-{pid}-")]
    if ending == "hang":
        time.sleep(1)  # the workers are now waiting on positions 12 and on
    workers = {p for p in children(pid) if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()}
    assert len(workers) == 2, workers
    if ending == "raise":
        process.stdin.write("\n")
        process.stdin.flush()
    else:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    killed = time.monotonic()
    while (any(alive(p) for p in workers) or shm_names(pid)) and time.monotonic() < killed + 15:
        time.sleep(0.1)
    left = [p for p in workers if alive(p)]
    assert not left, f"workers alive {time.monotonic() - killed:.1f} s after the main process"
    assert not shm_names(pid)
    if ending == "raise":
        assert "the training step failed" in process.stderr.read()
        assert not os.listdir(disk)
        return
    assert os.listdir(disk)  # SIGKILL leaves the directory; the next loader takes it back
    dl = DataLoader(
        FileDataset(files), batch_size=4, cache_ram="1MiB", cache_disk=disk, cache_disk_bytes="1MiB"
    )
    next(iter(dl))
    assert [name for name in os.listdir(disk) if not name.startswith(f"prescient-{os.getpid()}-")] == []
    dl.close()


def test_stale_segments_are_reclaimed_and_segments_reserved(files):
    """A segment left by a dead pid (its resource tracker killed too) goes when the next loader
    starts; a live loader's segment has every page allocated, so others see the space as taken."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/dev/shm/prescient_{dead.pid}_0123456789ab"
    with open(stale, "wb") as handle:
        handle.write(b"x" * 4096)
    dl = DataLoader(FileDataset(files), batch_size=4, cache_ram="4MiB")
    next(iter(dl))
    assert not os.path.exists(stale)
    segment = os.stat(f"/dev/shm/{dl._engine.shared.name}")
    assert segment.st_blocks * 512 >= segment.st_size >= 4 << 20
    dl.close()


SMALL_SHM_SCRIPT = textwrap.dedent("""
    import os, sys, warnings, torch
    from loader import DataLoader, FileDataset
    from loader.cache.ram import Layout, SharedMemoryFull, SharedState
    decode = lambda raw: torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)
    dataset = FileDataset(sys.argv[1], decode=decode)
    # two loaders start before either has filled its cache: each asks 16 MiB of a 32 MiB /dev/shm
    loaders = [DataLoader(dataset, batch_size=16, shuffle=True, cache_ram="16MiB", prefetch_bytes="2MiB")
               for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iterators = [iter(dl) for dl in loaders]
        firsts = [next(it) for it in iterators]
    print("WARNED", [str(w.message)[:80] for w in caught])
    for epoch in range(2):
        for dl in loaders:
            for batch in dl:
                pass
    print("SHM", sum(dl.stats()["shared_memory_bytes"] for dl in loaders))
    try:
        SharedState(Layout(samples=8, rows=3, ring=16, snap_slots=1, arena=16 << 20))
    except SharedMemoryFull as error:
        print("FULL", error)
""")


@pytest.mark.slow  # training programs in fresh interpreters
def test_loaders_sharing_a_small_dev_shm_never_overcommit_it(tmp_path):
    """Two loaders on a 32 MiB /dev/shm (a private tmpfs in a mount namespace, as in a default Docker
    container): the second is sized against what the first reserved, both fill their caches, no
    SIGBUS; a third segment that cannot fit is a clear error."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m (root) to give the test its own small /dev/shm")
    root = write_files(tmp_path / "data", 400, size=lambda i: 64 << 10)  # 25 MiB of samples
    command = f'mount -t tmpfs -o size=32m tmpfs /dev/shm && exec {sys.executable} -c "$0" {root}'
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, SMALL_SHM_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.getcwd(),
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])  # -7 is a SIGBUS
    assert "do not fit in the free space of" in result.stdout
    shm = int(result.stdout.split("SHM ")[1].split()[0])
    assert 20 << 20 < shm <= 32 << 20
    assert "FULL shared memory: cannot reserve" in result.stdout and "Lower cache_ram" in result.stdout


def test_segment_that_cannot_fit_is_a_clear_error_not_sigbus():
    total = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    before = shm_names(os.getpid())
    with pytest.raises(SharedMemoryFull, match="cannot reserve .* bytes in /dev/shm .* Lower cache_ram"):
        SharedState(Layout(samples=8, rows=3, ring=16, snap_slots=1, arena=2 * total))
    assert shm_names(os.getpid()) == before
