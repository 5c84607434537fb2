"""DLIO-style loader benchmark: torch's DataLoader against loader.DataLoader, same run,
same dataset, same workers.

Storage is simulated: every read of a sample costs a fixed latency, and all reads share
one link of fixed bandwidth (reads queue for it, across threads and worker processes).
Training is simulated by a fixed compute time per step. Accelerator utilization is
compute time / wall time per epoch (as DLIO and MLPerf Storage report it); stall is the
time the training loop waited in next().
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.utils.data as tud

from loader import DataLoader
from loader.placement import optimal_reads
from loader.plan import plan_epoch

SAMPLES = 8192
SAMPLE_BYTES = 32 << 10
BATCH = 32
STEP_SECONDS = 0.040           # simulated compute per step: needs 800 samples/s
WORKERS = 2
EPOCHS = 3


class SimulatedStorage(tud.Dataset):
    """Files on local disk, read through a simulated network storage: `latency` seconds
    per read, plus `size / bandwidth` seconds on a link shared by every reader."""

    def __init__(self, root: str, latency: float, bandwidth: float):
        self.paths = [os.path.join(root, f"{i:05d}.bin") for i in range(SAMPLES)]
        self.latency, self.bandwidth = latency, bandwidth
        self.link_free_at = multiprocessing.Value("d", 0.0)   # when the link can start the next transfer
        self.reads = multiprocessing.Value("q", 0)

    def __len__(self) -> int:
        return SAMPLES

    def nbytes(self, index: int) -> int:
        return SAMPLE_BYTES

    def read(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as handle:
            raw = handle.read()
        now = time.monotonic()
        transfer = len(raw) / self.bandwidth if self.bandwidth else 0.0
        with self.link_free_at.get_lock():
            start = max(now, self.link_free_at.value)
            self.link_free_at.value = start + transfer
        with self.reads.get_lock():
            self.reads.value += 1
        delay = start + transfer + self.latency - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return raw

    def decode(self, raw: bytes, index: int) -> tuple[torch.Tensor, int]:
        pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return pixels[:1024].float() / 255 + torch.rand(1), index % 10

    def __getitem__(self, index: int):
        return self.decode(self.read(index), index)


def train(dl, epochs: int, step_seconds: float = STEP_SECONDS) -> list[dict]:
    rows = []
    for epoch in range(epochs):
        stall, steps, samples = 0.0, 0, 0
        start = time.perf_counter()
        iterator = iter(dl)
        while True:
            waited = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                stall += time.perf_counter() - waited
                break
            stall += time.perf_counter() - waited
            if step_seconds:
                time.sleep(step_seconds)               # the accelerator computes
            steps += 1
            samples += len(batch[1])
        wall = time.perf_counter() - start
        rows.append({"epoch": epoch + 1, "utilization": steps * step_seconds / wall if step_seconds else None,
                     "samples/s": samples / wall, "stall_s": stall})
    return rows


def compare(name: str, storage: SimulatedStorage, epochs: int = EPOCHS, torch_epochs: int = EPOCHS,
            step: float = STEP_SECONDS, **cache) -> list[dict]:
    """Both loaders on the same storage with the same arguments; one row per epoch."""
    rows = []
    for label, cls, extra, count in (("torch", tud.DataLoader, {}, torch_epochs),
                                     ("loader", DataLoader, cache, epochs)):
        dl = cls(storage, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0),
                 num_workers=WORKERS, persistent_workers=True, **extra)
        for epoch in range(count):
            before = storage.reads.value
            (row,) = train(dl, 1, step)
            rows.append({"config": name, "loader": label, **row, "epoch": epoch + 1,
                         "storage_reads": storage.reads.value - before})
        if label == "loader":
            dl.close()
        del dl
    return rows


def predicted_optimum(capacity: int, epochs: int) -> list[int]:
    """Storage reads per epoch the plan predicts for a Belady cache of `capacity` bytes."""
    generator = torch.Generator().manual_seed(0)
    dl = tud.DataLoader(range(SAMPLES), batch_size=BATCH, shuffle=True, generator=generator)
    iter(dl)                                   # the base-seed draw torch makes before epoch 1
    plan = plan_epoch(dl._index_sampler, loader_generator=generator, new_iterator_each_epoch=False,
                      horizon_epochs=epochs)
    return optimal_reads([plan.indices, *plan.following], lambda i: SAMPLE_BYTES, capacity)


def run() -> dict:
    root = tempfile.mkdtemp(prefix="prescient-bench-")
    rng = np.random.default_rng(0)
    for i in range(SAMPLES):
        with open(os.path.join(root, f"{i:05d}.bin"), "wb") as handle:
            handle.write(rng.integers(0, 256, SAMPLE_BYTES, dtype=np.uint8).tobytes())
    data_bytes = SAMPLES * SAMPLE_BYTES
    rows, notes = [], []
    try:
        slow = SimulatedStorage(root, latency=0.005, bandwidth=200e6)
        rows += compare("5ms, 200MB/s, cache holds data", slow, torch_epochs=2, cache_ram=data_bytes)
        rows += compare("5ms, 200MB/s, no cache", slow, epochs=2, torch_epochs=1)
        starved = SimulatedStorage(root, latency=0.005, bandwidth=20e6)
        capacity = int(0.3 * data_bytes)
        optimum = predicted_optimum(capacity, EPOCHS)
        cached = compare("5ms, 20MB/s, cache 30%", starved, torch_epochs=1, cache_ram=capacity)
        for row in cached:
            if row["loader"] == "loader":
                row["optimal_reads"] = optimum[row["epoch"] - 1]
        rows += cached
        fast = SimulatedStorage(root, latency=0.0, bandwidth=0.0)
        rows += compare("fast storage (page cache)", fast, epochs=2, torch_epochs=2)
        rows += compare("fast storage, no compute", fast, epochs=2, torch_epochs=2, step=0.0,
                        cache_ram=data_bytes)
        notes.append("torch's epochs are alike (no cache), so some configurations run fewer of them.")
        notes.append(f"{SAMPLES} samples x {SAMPLE_BYTES >> 10} KiB, batch {BATCH}, {WORKERS} workers "
                     f"(persistent) for both loaders, {STEP_SECONDS * 1e3:.0f} ms compute per step "
                     f"(needs {BATCH / STEP_SECONDS:,.0f} samples/s); loader: 16 prefetch threads, 64 MiB staging.")
        notes.append("storage_reads counts reads at the simulated storage; optimal_reads is the plan's "
                     "prediction (Belady over the seeded order) for a cache of 30% of the data.")
        for config in dict.fromkeys(r["config"] for r in rows):
            last = {r["loader"]: r for r in rows if r["config"] == config}
            utilization = (f"last epoch utilization torch {last['torch']['utilization']:.2f}, loader "
                           f"{last['loader']['utilization']:.2f}; " if last["torch"]["utilization"] else "")
            notes.append(f"{config}: {utilization}samples/s ratio loader/torch "
                         f"{last['loader']['samples/s'] / last['torch']['samples/s']:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"title": "Clairvoyant DataLoader vs torch DataLoader (DLIO-style, simulated storage)",
            "rows": rows, "notes": notes}
