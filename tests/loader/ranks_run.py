"""One rank of the multi-rank loader tests (started by forked_ranks.py from test_ranks.py and
test_peer_checks.py; under torchrun it runs the same way).

    python -m tests.loader.ranks_run MODE ROOT OUT_DIR [ARG]

reads  ARG=epochs: peer exchange with a per-rank cache of 1.15 x dataset / world; batches
       compared with torch's DataLoader over the same DistributedSampler in this process;
       storage reads per epoch as the dataset counted them.
kill   ARG=rank: that rank SIGKILLs itself in epoch 2; the others must finish with torch's batches,
       and regroup for epoch 3.
stall  ARG=rank: that rank SIGSTOPs itself in epoch 2 (the test sends SIGCONT once the others are done).
corrupt  ARG=rank: a test hook in that rank flips the first byte of every payload it sends, after its
       loader computed the checksums (as a bad NIC or bad memory would); 3 epochs as in `reads`.
padded ARG=rank: a test hook in that rank serves every sample with 16 bytes more than the
       dataset's file holds; 3 epochs.
huge   ARG=rank: the same with 1 MiB more, past what a peer's caches could hold.
save   ROOT=samples, ARG=batches: iterate that many batches of epoch 1, write this rank's
       state_dict (rank<r>.pt) and the sample ids it was given.
resume ROOT=samples, ARG=a saved state: finish epoch 1 from it (resumed<r>.json: the ids
       given), then run epoch 2 and compare it with torch's DistributedSampler.
Each rank writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data import DistributedSampler

from loader import DataLoader
from tests.loader.conftest import SAMPLE_BYTES, CountingFiles, noisy_decode, same

BATCH = 4
PEER_TIMEOUT = 3.0


def run_epochs(dl, sampler, epochs: int) -> list[list]:
    return [batch for epoch in range(epochs) for batch in run_epoch(dl, sampler, epoch)]


def peer_loader(dataset, sampler, world: int) -> DataLoader:
    per_rank = int(1.15 * len(dataset) / world * SAMPLE_BYTES)
    return DataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        cache_ram=per_rank,
        prefetch_bytes=16 * SAMPLE_BYTES,
        peer_exchange=True,
        peer_window=8,
        peer_timeout=PEER_TIMEOUT,
    )


def compare_with_torch(root: str, out_dir: str, epochs: int, on_batch=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = CountingFiles(root, decode=noisy_decode)
    theirs = run_epochs(
        tud.DataLoader(dataset, batch_size=BATCH, sampler=(s := DistributedSampler(dataset, seed=5))),
        s,
        epochs,
    )
    dist.barrier()
    sampler = DistributedSampler(dataset, seed=5)
    dl = peer_loader(dataset, sampler, world)
    before, peers_before = int(dataset.read_counts().sum()), 0
    reads, peer_reads = [], []

    def counted(epoch, step):
        if on_batch is not None:
            on_batch(epoch, step)

    ours = []
    for epoch in range(epochs):
        ours += run_epoch(dl, sampler, epoch, counted)
        now, peers_now = int(dataset.read_counts().sum()), dl.stats()["peer_reads"]
        reads.append(now - before)
        peer_reads.append(peers_now - peers_before)
        before, peers_before = now, peers_now
    stats = dl.stats()
    result = {
        "rank": rank,
        "same": same(theirs, ours),
        "reads": reads,
        "peer_reads": stats["peer_reads"],
        "peer_reads_per_epoch": peer_reads,
        "storage_reads": stats["storage_reads"],
        "peers_lost": dl._engine.prefetcher.peers_lost,
        "peer_failures": stats["peer_failures"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dl.close()


def run_epoch(dl, sampler, epoch: int, on_batch=None) -> list[list]:
    """One epoch's batches (in a list of one); the RNGs are seeded before the first."""
    if epoch == 0:
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
    sampler.set_epoch(epoch)
    batches = []
    for step, batch in enumerate(dl):
        batches.append(batch)
        if on_batch is not None:
            on_batch(epoch, step)
    return [batches]


def main(mode: str, root: str, out_dir: str, arg: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=False)  # a hang shows its stacks before the test's timeout
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "reads":
        compare_with_torch(root, out_dir, int(arg))
        dist.barrier()
    elif mode == "kill":

        def die(epoch, step):
            if rank == int(arg) and epoch == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        compare_with_torch(root, out_dir, 3, die)
        return  # no barrier or teardown: a rank is gone
    elif mode == "stall":

        def stall(epoch, step):
            if rank == int(arg) and epoch == 1 and step == 1:
                # the whole process stops (as a hung node would) until the test sends SIGCONT
                with open(os.path.join(out_dir, "stopped.pid"), "w") as handle:
                    handle.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)

        compare_with_torch(root, out_dir, 2, stall)
        return
    elif mode in ("corrupt", "padded", "huge"):
        if rank == int(arg):
            faulty_sends(mode)
        compare_with_torch(root, out_dir, 3)
        dist.barrier()
    elif mode == "save":
        elastic_save(root, out_dir, int(arg))
    elif mode == "resume":
        elastic_resume(root, out_dir, arg)
    dist.destroy_process_group()


def faulty_sends(kind: str) -> None:
    """Make this rank a faulty peer (test hook: only the bytes it sends to peers change)."""
    import loader.peers.exchange
    from loader.cache.holdings import Holdings

    if kind == "corrupt":

        class FlippingTorch:
            """loader.peers.exchange's `torch`, whose frombuffer (the payload about to be sent) flips a byte."""

            def __getattr__(self, name):
                return getattr(torch, name)

            @staticmethod
            def frombuffer(buffer, **kwargs):
                if len(buffer):
                    buffer[0] ^= 0xFF
                return torch.frombuffer(buffer, **kwargs)

        loader.peers.exchange.torch = FlippingTorch()
    else:
        copy_of, pad = Holdings.copy_of, bytes(16 if kind == "padded" else 1 << 20)
        Holdings.copy_of = lambda self, index: None if (raw := copy_of(self, index)) is None else raw + pad


class Indexed(tud.Dataset):
    """Sample i is the int i (read as 8 bytes, decoded back): batches say which samples came."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def read(self, index: int) -> bytes:
        return index.to_bytes(8, "little")

    def decode(self, raw: bytes, index: int) -> int:
        return int.from_bytes(raw, "little")

    def __getitem__(self, index: int) -> int:
        return self.decode(self.read(index), index)


def elastic_loader(n: int, **peers):
    dataset = Indexed(n)
    sampler = DistributedSampler(dataset, seed=5)
    sampler.set_epoch(0)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, cache_ram="1MiB", **peers), sampler


def elastic_save(root: str, out_dir: str, batches: int) -> None:
    dl, _ = elastic_loader(int(root))
    rank, seen = dist.get_rank(), []
    for step, batch in enumerate(dl):
        seen += batch.tolist()
        if step + 1 == batches:
            break
    torch.save(dl.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"rank": rank, "seen": seen}, handle)
    dl.close()


def elastic_resume(root: str, out_dir: str, checkpoint: str) -> None:
    n = int(root)
    # with peer exchange: the new ranks' shares differ by a sample, their exchange windows still pair up
    dl, sampler = elastic_loader(n, peer_exchange=True, peer_window=8, peer_timeout=PEER_TIMEOUT)
    dl.load_state_dict(torch.load(checkpoint, weights_only=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    rest = [batch.tolist() for batch in dl]
    sampler.set_epoch(1)
    following = [batch.tolist() for batch in dl]
    expected = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=5)
    expected.set_epoch(1)
    order = list(expected)
    with open(os.path.join(out_dir, f"resumed{rank}.json"), "w") as handle:
        json.dump(
            {
                "rank": rank,
                "seen": [i for batch in rest for i in batch],
                "batch_sizes": [len(b) for b in rest],
                "next_epoch_is_torchs": following
                == [order[i : i + BATCH] for i in range(0, len(order), BATCH)],
                "peers_lost": dl._engine.prefetcher.peers_lost,
            },
            handle,
        )
    dl.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
