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
import torch

from loader import DataLoader, FileDataset
from tests.loader.conftest import noisy_decode, shm_names, write_files


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
    sizes = lambda i: 40 + (i * 37) % 200                     # noqa: E731 - uneven samples
    dataset = FileDataset(write_files(tmp_path / "data", 80, size=sizes), decode=noisy_decode)
    ram, disk, staging = 2000, 3000, 900
    dl = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2),
                    num_workers=workers, cache_ram=ram, cache_disk=str(tmp_path / "disk"), cache_disk_bytes=disk,
                    prefetch_bytes=staging)
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
    assert stats["cache_ram_peak_bytes"] > ram * 0.8 and stats["disk_hits"] > 0   # the tiers were used
    assert stats["shared_memory_bytes"] == ram + staging
    assert segment < ram + staging + (4 << 20)                # data area plus control block and rings
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
    import sys, torch
    from loader import DataLoader, FileDataset
    decode = lambda raw: torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)
    dl = DataLoader(FileDataset(sys.argv[1], decode=decode), batch_size=2, num_workers=2,
                    persistent_workers=True, cache_ram="1MiB")
    for step, batch in enumerate(dl):
        if step == 3:
            print("iterating", flush=True)
            if sys.argv[2] == "raise":
                raise ValueError("the training step failed")
            import time; time.sleep(60)
""")


@pytest.mark.parametrize("ending", ["raise", "sigkill"])
def test_released_when_the_process_dies(files, ending):
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, files, ending], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert process.stdout.readline().strip() == "iterating"
    pid = process.pid
    assert shm_names(pid), "the loader should hold a segment while it runs"
    if ending == "sigkill":
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    deadline = time.monotonic() + 30          # workers notice the dead parent, then the tracker unlinks
    while shm_names(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm_names(pid)
    if ending == "raise":
        assert "the training step failed" in process.stderr.read()


def test_cache_larger_than_dev_shm_is_shrunk_with_a_warning(files):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    dl = DataLoader(FileDataset(files, decode=noisy_decode), batch_size=4, cache_ram=free * 2)
    with pytest.warns(RuntimeWarning, match="do not fit in the free space of /dev/shm"):
        batches = list(dl)
    stats = dl.stats()
    dl.close()
    assert len(batches) == 12 and stats["shared_memory_bytes"] <= free
