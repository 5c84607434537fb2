"""Peer exchange across two real ranks (forked_ranks.py, gloo on CPU): after epoch 1 every sample
either rank needs is held by one of them, so storage is not read again; the samples come
from the peer and the batches still equal torch's."""

from __future__ import annotations

import json
import sys

import pytest

from tests.loader.conftest import write_files
from tests.loader.forked_ranks import launcher_output, run_logs

pytestmark = pytest.mark.slow  # real ranks, each a process

WORKERS = (0, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[str, str]]:
    """Two ranks of peer_run.py with 0 and with 2 loader workers, one run after the other under one
    launcher (one import of torch): per worker count, its output directory and its log."""
    tmp = tmp_path_factory.mktemp("peer_exchange")
    root = write_files(tmp / "data", 64)
    command = [sys.executable, "-m", "tests.loader.forked_ranks"]
    for workers in WORKERS:
        (tmp / f"w{workers}").mkdir()
        command += ["2", "tests.loader.peer_run", root, str(tmp / f"w{workers}"), str(workers), "--"]
    log = launcher_output(command, timeout=360)
    logs = run_logs(log) + [log] * len(WORKERS)
    return {workers: (tmp / f"w{workers}", logs[i]) for i, workers in enumerate(WORKERS)}


@pytest.mark.parametrize("workers", WORKERS)
def test_two_ranks_take_samples_from_each_other(runs, workers):
    out, log = runs[workers]
    files = [out / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files) and "ended with" not in log, log[-6000:]
    ranks = [json.loads(f.read_text()) for f in files]
    for rank in ranks:
        assert rank["same"], f"rank {rank['rank']}: batches differ from torch's"
        assert rank["reads"][0] == 32, "epoch 1 reads this rank's half once"
        assert rank["reads"][1] == 0 and rank["reads"][2] == 0, rank
        assert rank["storage_reads"] == 32 and rank["samples"] == 96
    # In epoch 2 each rank needs about half of its samples from the other one.
    assert all(r["peer_reads"] > 8 for r in ranks)
