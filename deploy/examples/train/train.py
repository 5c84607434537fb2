"""Train a tiny image classifier with `loader.DataLoader` under torchrun, its loader metrics on /metrics.

    torchrun --nproc-per-node 2 deploy/examples/train/train.py --data /tmp/shapes --epochs 3

The dataset is made on the spot (once per directory): small grayscale images as PGM files in one
folder per class, each class a bright bar in its own place plus noise. Each rank reads its
DistributedSampler shard through the loader, which caches the files' bytes (`--cache-ram`) so that
after the first epoch storage is read only for samples the rank has not seen yet. Loader series
(`prescient:loader_*`) are served in Prometheus's text format on `--metrics-port` + local rank.
Each rank writes its losses and loader stats to `--out`/rank<N>.json when asked.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from loader import DataLoader, FileDataset

SIDE = 12  # pixels per image side
CLASSES = 4


def make_dataset(root: str, samples: int, seed: int = 0) -> None:
    """SIDE x SIDE PGM images: class k has a bright horizontal bar at rows 3k..3k+2, under noise."""
    if os.path.isdir(root) and os.listdir(root):
        return
    generator = torch.Generator().manual_seed(seed)
    for k in range(CLASSES):
        os.makedirs(os.path.join(root, f"class{k}"), exist_ok=True)
    for i in range(samples):
        k = i % CLASSES
        image = torch.randint(0, 160, (SIDE, SIDE), generator=generator, dtype=torch.uint8)
        image[3 * k : 3 * k + 3] += 40
        header = f"P5\n{SIDE} {SIDE}\n255\n".encode()
        path = os.path.join(root, f"class{k}", f"{i:05d}.pgm")
        with open(path + ".tmp", "wb") as f:
            f.write(header + image.numpy().tobytes())
        os.replace(path + ".tmp", path)  # another rank never sees half a file


def decode_pgm(raw: bytes) -> torch.Tensor:
    magic, size, maxval, pixels = raw.split(b"\n", 3)
    width, height = map(int, size.split())
    assert magic == b"P5" and maxval == b"255", "not an 8-bit binary PGM"
    return torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(1, height, width).float() / 255


class LoggedFiles(FileDataset):
    """FileDataset that appends each storage read's index to a file (any process, O_APPEND)."""

    def __init__(self, root: str, read_log: str | None):
        super().__init__(root, decode=decode_pgm)
        self.read_log = read_log

    def read(self, index: int) -> bytes:
        if self.read_log:
            fd = os.open(self.read_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{index}\n".encode())
            finally:
                os.close(fd)
        return super().read(index)


def serve_metrics(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """prometheus_client's default registry in the text format, which keeps the `:` in our names."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(REGISTRY)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * (SIDE // 2) ** 2, CLASSES),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset directory (made here if empty)")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--cache-ram", default="16MiB")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve /metrics on this port + the local rank (0: off)"
    )
    p.add_argument("--read-log", default=None, help="append each storage read's index to FILE.rank<N>")
    p.add_argument("--out", default=None, help="write rank<N>.json (losses, loader stats) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # once per node: pods do not share a disk
        make_dataset(args.data, args.samples, args.seed)
    if distributed:
        dist.barrier()
    if args.metrics_port:
        serve_metrics(args.metrics_port + int(os.environ.get("LOCAL_RANK", 0)))

    read_log = f"{args.read_log}.rank{rank}" if args.read_log else None
    dataset = LoggedFiles(args.data, read_log)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        cache_ram=args.cache_ram,
        name="train",
    )
    torch.manual_seed(args.seed)
    net = model()
    if distributed:
        net = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = nn.functional.cross_entropy(net(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if rank == 0:
            print(f"epoch {epoch}: loss {sum(losses[-len(loader) :]) / len(loader):.3f}", flush=True)
    stats = loader.stats()
    loader.close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "world": world,
                    "losses": losses,
                    "stats": stats,
                    "samples": len(dataset),
                    "paths": dataset.paths,
                },
                f,
            )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
