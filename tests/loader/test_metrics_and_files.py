"""stats() as Prometheus series scraped over HTTP, and FileDataset's layout rules."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest
import torch

from loader import DataLoader, FileDataset
from tests.loader.conftest import SAMPLE_BYTES, shuffled, write_files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, loader_name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("prescient:loader_") and f'loader="{loader_name}"' in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = value
    return values


def test_prometheus_series_match_stats(counting):
    from prometheus_client import start_http_server

    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1")
    try:
        dataset = counting(30)
        dl = DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2, cache_ram="1MiB", name="train")
        for _ in range(2):
            for _ in dl:
                pass
        stats = dl.stats()
        series = scrape(port, "train")
        dl.close()
    finally:
        server.shutdown()
    assert stats["samples"] == 60 and stats["storage_reads"] == 30 and stats["ram_hits"] == 30
    assert stats["epochs"] == 2
    assert dataset.read_counts().sum() == stats["storage_reads"]
    for key in (
        "samples",
        "storage_reads",
        "storage_bytes",
        "ram_hits",
        "disk_hits",
        "peer_reads",
        "peer_failures",
        "batches",
        "epochs",
    ):
        assert series[f"prescient:loader_{key}_total"] == stats[key], key
    assert series["prescient:loader_stall_seconds_total"] == pytest.approx(stats["stall_seconds"])
    assert series["prescient:loader_cache_ram_bytes"] == 30 * SAMPLE_BYTES


def test_file_dataset_class_layout_and_flat_layout(tmp_path):
    root = write_files(tmp_path / "classes", 12, classes=3)
    dataset = FileDataset(root)
    assert dataset.classes == ["class0", "class1", "class2"] and len(dataset) == 12
    for index in range(12):
        sample, label = dataset[index]
        assert os.path.basename(os.path.dirname(dataset.path(index))) == f"class{label}"
        with open(dataset.path(index), "rb") as handle:
            assert bytes(sample.tolist()) == handle.read()
        assert dataset.nbytes(index) == SAMPLE_BYTES
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("b.bin", "a.bin", "c.txt", ".hidden"):
        (flat / name).write_bytes(name.encode())
    only_bin = FileDataset(flat, decode=bytes, transform=lambda raw: raw.upper(), extensions=(".bin",))
    assert [only_bin[i] for i in range(len(only_bin))] == [b"A.BIN", b"B.BIN"]
    with pytest.raises(FileNotFoundError, match="no files"):
        FileDataset(flat, extensions=(".png",))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        FileDataset(tmp_path / "missing")


def test_cache_items_for_a_deterministic_plain_dataset():
    """A dataset without read/decode declared deterministic is cached whole (pickled)."""

    class Squares(torch.utils.data.Dataset):
        def __init__(self):
            self.calls = 0

        def __len__(self):
            return 20

        def __getitem__(self, index):
            self.calls += 1
            return {"x": torch.tensor([index * index]), "i": index}

    data = Squares()
    reference = shuffled(Squares(), 3, seed=4, cls=torch.utils.data.DataLoader)
    theirs = [list(reference) for _ in range(3)]
    dl = shuffled(data, 3, seed=4, cache_items=True, cache_ram="1MiB")
    epochs = [list(dl) for _ in range(3)]
    stats = dl.stats()
    dl.close()
    assert [len(e) for e in epochs] == [len(e) for e in theirs]
    assert all(
        torch.equal(a["x"], b["x"]) and torch.equal(a["i"], b["i"])
        for ours, reference_epoch in zip(epochs, theirs)
        for a, b in zip(reference_epoch, ours)
    )
    assert data.calls == 20 and stats["storage_reads"] == 20 and stats["ram_hits"] == 40
