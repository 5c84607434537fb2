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
from loader.plan.placement import optimal_reads
from loader.plan.plan import plan_epoch
from tests.bench import loader_ranks
from tests.processes import process_stats

SAMPLES = 8192
SAMPLE_BYTES = 32 << 10
BATCH = 32
STEP_SECONDS = 0.040  # simulated compute per step: needs 800 samples/s
WORKERS = 2
EPOCHS = 3


class SimulatedStorage(tud.Dataset):
    """Files on local disk, read through a simulated network storage: `latency` seconds
    per read, plus `size / bandwidth` seconds on a link shared by every reader."""

    def __init__(self, root: str, latency: float, bandwidth: float, count: int = SAMPLES):
        self.paths = [os.path.join(root, f"{i:05d}.bin") for i in range(count)]
        self.latency, self.bandwidth = latency, bandwidth
        self.link_free_at = multiprocessing.Value("d", 0.0)  # when the link can start the next transfer
        self.reads = multiprocessing.Value("q", 0)

    def __len__(self) -> int:
        return len(self.paths)

    def nbytes(self, index: int) -> int:
        return os.path.getsize(self.paths[index])

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


def process_tree_cpu() -> float:
    """CPU seconds used so far by this process and its live children (the loader's workers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    me = os.getpid()
    for pid, fields in process_stats():
        if pid == me or int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def train(dl, epochs: int, step_seconds: float = STEP_SECONDS) -> list[dict]:
    rows = []
    for epoch in range(epochs):
        stall, steps, samples = 0.0, 0, 0
        cpu = process_tree_cpu()
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
                time.sleep(step_seconds)  # the accelerator computes
            steps += 1
            samples += len(batch[1])
        wall = time.perf_counter() - start
        rows.append(
            {
                "epoch": epoch + 1,
                "utilization": steps * step_seconds / wall if step_seconds else None,
                "samples/s": samples / wall,
                "stall_s": stall,
                "cpu_us/sample": (process_tree_cpu() - cpu) / max(samples, 1) * 1e6,
            }
        )
    return rows


def compare(
    name: str,
    storage: SimulatedStorage,
    epochs: int = EPOCHS,
    torch_epochs: int = EPOCHS,
    step: float = STEP_SECONDS,
    batch: int = BATCH,
    label: str = "loader",
    **cache,
) -> list[dict]:
    """Both loaders on the same storage with the same arguments; one row per epoch."""
    rows = []
    for who, cls, extra, count in (
        ("torch", tud.DataLoader, {}, torch_epochs),
        (label, DataLoader, cache, epochs),
    ):
        if count == 0:
            continue
        dl = cls(
            storage,
            batch_size=batch,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=WORKERS,
            persistent_workers=True,
            **extra,
        )
        for epoch in range(count):
            before = storage.reads.value
            (row,) = train(dl, 1, step)
            rows.append(
                {
                    "config": name,
                    "loader": who,
                    **row,
                    "epoch": epoch + 1,
                    "storage_reads": storage.reads.value - before,
                }
            )
        if who != "torch":
            dl.close()
        del dl
    return rows


def predicted_optimum(capacity: int, epochs: int) -> list[int]:
    """Storage reads per epoch the plan predicts for a Belady cache of `capacity` bytes."""
    generator = torch.Generator().manual_seed(0)
    dl = tud.DataLoader(range(SAMPLES), batch_size=BATCH, shuffle=True, generator=generator)
    iter(dl)  # the base-seed draw torch makes before epoch 1
    plan = plan_epoch(
        dl._index_sampler, loader_generator=generator, new_iterator_each_epoch=False, horizon_epochs=epochs
    )
    return optimal_reads([plan.indices, *plan.following], lambda i: SAMPLE_BYTES, capacity)


def write_samples(root: str, count: int, size: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        with open(os.path.join(root, f"{i:05d}.bin"), "wb") as handle:
            handle.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


def issue_cases(repeats: int = 3) -> tuple[list[dict], list[str]]:
    """The cases a new user tries first, each against torch in the same run, alternating:
    fast local storage with no compute (20,000 samples of 4 KB, batch 64), and slow storage
    (3 ms a sample, 25 ms a step, 32 batches of 32 an epoch)."""
    rows, notes = [], []
    root = tempfile.mkdtemp(prefix="prescient-bench-")
    try:
        write_samples(root, 20_000, 4096)
        fast = SimulatedStorage(root, latency=0.0, bandwidth=0.0, count=20_000)
        slow = SimulatedStorage(root, latency=0.003, bandwidth=0.0, count=1024)
        for _ in range(repeats):
            rows += compare("fast, no compute, no cache", fast, epochs=2, torch_epochs=2, step=0.0, batch=64)
            rows += compare(
                "fast, no compute, cache_ram",
                fast,
                epochs=2,
                torch_epochs=0,
                step=0.0,
                batch=64,
                label="loader+cache",
                cache_ram=20_000 * 4096 + (16 << 20),
            )
            rows += compare("slow 3 ms, 25 ms step", slow, epochs=3, torch_epochs=2, step=0.025, batch=32)
        for row in rows:
            row["config"] = row["config"].replace(", cache_ram", ", no cache")  # one torch baseline
        notes += summarize(rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return median_rows(rows, repeats), notes


def median_rows(rows: list[dict], repeats: int) -> list[dict]:
    """One row per (config, loader, epoch): the median of each figure over the repeats."""
    import statistics

    out = []
    for key in dict.fromkeys((r["config"], r["loader"], r["epoch"]) for r in rows):
        mine = [r for r in rows if (r["config"], r["loader"], r["epoch"]) == key]
        row = dict(mine[0], repeats=repeats)
        for field, value in mine[0].items():
            if isinstance(value, (int, float)) and field != "epoch" and value is not None:
                row[field] = statistics.median(r[field] for r in mine)
        out.append(row)
    return out


def summarize(rows: list[dict]) -> list[str]:
    """Medians over the repeats of each (config, loader, epoch), as ratios to torch's."""
    import statistics

    notes = []
    keys = dict.fromkeys((r["config"], r["loader"], r["epoch"]) for r in rows)

    def median(config, loader, epoch, field):
        values = [
            r[field]
            for r in rows
            if (r["config"], r["loader"], r["epoch"]) == (config, loader, epoch) and r[field] is not None
        ]
        return statistics.median(values) if values else None

    for config, loader, epoch in keys:
        if loader == "torch":
            continue
        base_epoch = min(epoch, 2)
        rate = median(config, loader, epoch, "samples/s") / median(config, "torch", base_epoch, "samples/s")
        cpu = median(config, loader, epoch, "cpu_us/sample") / median(
            config, "torch", base_epoch, "cpu_us/sample"
        )
        util = median(config, loader, epoch, "utilization")
        util_t = median(config, "torch", base_epoch, "utilization")
        extra = f", utilization {util:.2f} (torch {util_t:.2f})" if util is not None else ""
        notes.append(
            f"{config}, {loader} epoch {epoch}: samples/s {rate:.2f}x torch's, CPU per sample "
            f"{cpu:.2f}x torch's{extra} (medians)"
        )
    return notes


def run() -> dict:
    root = tempfile.mkdtemp(prefix="prescient-bench-")
    rng = np.random.default_rng(0)
    for i in range(SAMPLES):
        with open(os.path.join(root, f"{i:05d}.bin"), "wb") as handle:
            handle.write(rng.integers(0, 256, SAMPLE_BYTES, dtype=np.uint8).tobytes())
    data_bytes = SAMPLES * SAMPLE_BYTES
    rows, notes = issue_cases()
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
        rows += compare(
            "fast storage, no compute", fast, epochs=2, torch_epochs=2, step=0.0, cache_ram=data_bytes
        )
        notes.append("torch's epochs are alike (no cache), so some configurations run fewer of them.")
        notes.append(
            f"{SAMPLES} samples x {SAMPLE_BYTES >> 10} KiB, batch {BATCH}, {WORKERS} workers "
            f"(persistent) for both loaders, {STEP_SECONDS * 1e3:.0f} ms compute per step "
            f"(needs {BATCH / STEP_SECONDS:,.0f} samples/s); loader: a batch's reads in flight per worker, "
            "64 MiB staging."
        )
        notes.append(
            "storage_reads counts reads at the simulated storage; optimal_reads is the plan's "
            "prediction (Belady over the seeded order) for a cache of 30% of the data."
        )
        for config in dict.fromkeys(r["config"] for r in rows):
            last = {r["loader"]: r for r in rows if r["config"] == config}
            utilization = (
                f"last epoch utilization torch {last['torch']['utilization']:.2f}, loader "
                f"{last['loader']['utilization']:.2f}; "
                if last["torch"]["utilization"]
                else ""
            )
            notes.append(
                f"{config}: {utilization}samples/s ratio loader/torch "
                f"{last['loader']['samples/s'] / last['torch']['samples/s']:.3f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    distributed, distributed_notes = loader_ranks.rows()  # 4 and 8 torchrun ranks, and the 64/1,024 model
    return {
        "title": "Clairvoyant DataLoader vs torch DataLoader (DLIO-style, simulated storage)",
        "rows": rows + distributed,
        "notes": notes + distributed_notes,
    }
