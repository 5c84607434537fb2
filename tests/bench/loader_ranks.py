"""The distributed rows of bench_loader: torch's DataLoader against loader.DataLoader with
peer exchange on 4 and 8 real ranks (torchrun, gloo on CPU), same run, same simulated
storage; and the plan's model of 64 and 1,024 ranks (storage and network bytes per epoch).

    python -m torch.distributed.run --nproc_per_node=R -m tests.bench.loader_ranks OUT.json

runs one rank: torch's loader for EPOCHS epochs, then ours, each rank counting the reads
its storage served; rank 0 writes the totals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data import DistributedSampler

from loader import DataLoader
from loader.peers.model import traffic

SAMPLES = 512
SAMPLE_BYTES = 4096
LATENCY = 0.002  # seconds per storage read
BATCH = 8
EPOCHS = 3
CACHE_SHARE = 1.15  # the ranks' caches together hold 1.15 x the dataset
IMAGENET = (1_281_167, 110_000)  # samples, mean bytes (ImageNet-1k JPEGs)


class SlowStorage(tud.Dataset):
    """SAMPLES payloads behind LATENCY seconds per read; counts the reads served."""

    def __init__(self):
        self.reads = 0

    def __len__(self) -> int:
        return SAMPLES

    def read(self, index: int) -> bytes:
        time.sleep(LATENCY)
        self.reads += 1
        return bytes([index % 251]) * SAMPLE_BYTES

    def decode(self, raw: bytes, index: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw[:64]), dtype=torch.uint8).float() + torch.rand(1)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.decode(self.read(index), index)


def epochs(dl, storage: SlowStorage, sampler) -> tuple[list[int], list[float]]:
    reads, seconds = [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        dist.barrier()
        before, start = storage.reads, time.perf_counter()
        for _ in dl:
            pass
        seconds.append(time.perf_counter() - start)
        reads.append(storage.reads - before)
    return reads, seconds


def rank_main(out: str) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    storage = SlowStorage()
    sampler = DistributedSampler(storage, seed=0)
    torch_reads, torch_seconds = epochs(
        tud.DataLoader(storage, batch_size=BATCH, sampler=sampler), storage, sampler
    )
    dl = DataLoader(
        storage,
        batch_size=BATCH,
        sampler=sampler,
        cache_ram=int(CACHE_SHARE * SAMPLES * SAMPLE_BYTES / world),
        prefetch_bytes=32 * SAMPLE_BYTES,
        peer_exchange=True,
        peer_window=32,
    )
    ours_reads, ours_seconds = epochs(dl, storage, sampler)
    peer_reads = dl.stats()["peer_reads"]
    dl.close()
    totals = torch.tensor([torch_reads + ours_reads + [peer_reads]], dtype=torch.float64)
    slowest = torch.tensor([torch_seconds + ours_seconds], dtype=torch.float64)
    dist.all_reduce(totals)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        t, s = totals[0].tolist(), slowest[0].tolist()
        result = {
            "torch_reads": t[:EPOCHS],
            "loader_reads": t[EPOCHS : 2 * EPOCHS],
            "peer_reads": t[-1],
            "torch_seconds": s[:EPOCHS],
            "loader_seconds": s[EPOCHS:],
        }
        with open(out, "w") as handle:
            json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()


def measured(ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        command += ["-m", "tests.bench.loader_ranks", out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(command, check=True, env=env, capture_output=True, timeout=600)
        with open(out) as handle:
            return json.load(handle)


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 2) for v in values]


def rows() -> tuple[list[dict], list[str]]:
    """Measured rows for 4 and 8 ranks (torch and ours, same run), then the model's rows."""
    out, notes = [], []
    for ranks in (4, 8):
        result = measured(ranks)
        for who in ("torch", "loader"):
            for epoch in range(EPOCHS):
                out.append(
                    {
                        "config": f"{ranks} ranks, caches {CACHE_SHARE}x dataset in all",
                        "loader": who,
                        "epoch": epoch + 1,
                        "storage_reads": int(result[f"{who}_reads"][epoch]),
                        "epoch_seconds": result[f"{who}_seconds"][epoch],
                    }
                )
        total = sum(result["loader_reads"])
        notes.append(
            f"{ranks} ranks: storage reads over {EPOCHS} epochs {total:.0f} for {SAMPLES} samples "
            f"({total / SAMPLES:.3f}x the dataset; torch {sum(result['torch_reads']):.0f}); "
            f"{result['peer_reads']:.0f} samples from peers; slowest rank's epoch seconds torch "
            f"{_rounded(result['torch_seconds'])}, loader {_rounded(result['loader_seconds'])}"
        )
    n, size = IMAGENET
    for world in (64, 1024):
        for row in traffic(n, size, world, int(CACHE_SHARE * n * size / world), EPOCHS):
            out.append(
                {
                    "config": f"model: {world} ranks, ImageNet-1k, caches {CACHE_SHARE}x dataset in all",
                    "loader": "loader (plan)",
                    "epoch": row.epoch,
                    "storage_GB": row.storage_bytes / 1e9,
                    "network_GB": row.network_bytes / 1e9,
                    "torch_storage_GB": n * size / 1e9,
                }
            )
    notes.append(
        f"model rows: {n:,} samples x {size / 1e3:.0f} KB, DistributedSampler(seed=0), computed from the "
        "plan alone (loader/peers/model.py); network is an upper bound (a rank's spare cache is left out), "
        "torch reads the whole dataset from storage every epoch."
    )
    notes.append(
        f"measured rows: {SAMPLES} samples x {SAMPLE_BYTES >> 10} KiB behind {LATENCY * 1e3:.0f} ms a read, "
        f"batch {BATCH}, no workers, all ranks on this 2-core machine (seconds are the slowest rank's)."
    )
    return out, notes


if __name__ == "__main__":
    rank_main(sys.argv[1])
