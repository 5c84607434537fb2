"""One rank of the peer-exchange test (started by forked_ranks.py from test_peer_exchange.py;
under torchrun it runs the same way: python -m tests.loader.peer_run ROOT OUT_DIR WORKERS).

Each rank compares its batches with torch's DataLoader over the same DistributedSampler
in the same process, and reports the storage reads its dataset counted per epoch.
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data import DistributedSampler

from loader import DataLoader
from tests.loader.conftest import CountingFiles, noisy_decode, same


def main(root: str, out_dir: str, workers: str) -> None:
    workers = int(workers)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = CountingFiles(root, decode=noisy_decode)
    epochs = 3

    def batches(loader_cls, sampler, **extra):
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
        dl = loader_cls(dataset, batch_size=4, sampler=sampler, num_workers=workers, **extra)
        out, reads = [], []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            before = int(dataset.read_counts().sum())
            out.append(list(dl))
            reads.append(int(dataset.read_counts().sum()) - before)
        return dl, out, reads

    _, theirs, _ = batches(tud.DataLoader, DistributedSampler(dataset, seed=5))
    dist.barrier()
    dl, ours, reads = batches(
        DataLoader, DistributedSampler(dataset, seed=5), cache_ram="1MiB", peer_exchange=True, peer_window=16
    )
    stats = dl.stats()
    dl.close()
    result = {
        "rank": rank,
        "same": same(theirs, ours),
        "reads": reads,
        "peer_reads": stats["peer_reads"],
        "storage_reads": stats["storage_reads"],
        "samples": stats["samples"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
