"""Peer exchange across two real ranks (torchrun, gloo on CPU): after epoch 1 every sample
either rank needs is held by one of them, so storage is not read again; the samples come
from the peer and the batches still equal torch's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.loader.conftest import write_files

pytestmark = pytest.mark.slow  # real torchrun ranks


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_take_samples_from_each_other(tmp_path, workers):
    root = write_files(tmp_path / "data", 64)
    out = tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tests.loader.peer_run",
        root,
        str(out),
        str(workers),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=os.getcwd(), env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["same"], f"rank {rank['rank']}: batches differ from torch's"
        assert rank["reads"][0] == 32, "epoch 1 reads this rank's half once"
        assert rank["reads"][1] == 0 and rank["reads"][2] == 0, rank
        assert rank["storage_reads"] == 32 and rank["samples"] == 96
    # In epoch 2 each rank needs about half of its samples from the other one.
    assert all(r["peer_reads"] > 8 for r in ranks)
