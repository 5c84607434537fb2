"""deploy/examples/train/train.py under real torchrun: two ranks on CPU, a few steps each.

The loss must fall, and each rank's storage reads (logged by the dataset itself) must be exactly what
the plan allows with a cache that holds the shard: every sample of the rank's DistributedSampler
shards over the epochs (torch's own sampler is the oracle), each read once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from tests.server.conftest import ROOT, free_port

SCRIPT = os.path.join(ROOT, "deploy", "examples", "train", "train.py")


@pytest.mark.slow
def test_torchrun_two_ranks_learn_and_read_storage_as_planned(tmp_path):
    epochs, samples = 3, 256
    out, data = tmp_path / "out", tmp_path / "data"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        SCRIPT,
        "--data",
        str(data),
        "--samples",
        str(samples),
        "--epochs",
        str(epochs),
        "--batch-size",
        "16",
        "--workers",
        "1",
        "--out",
        str(out),
        "--read-log",
        str(tmp_path / "reads"),
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        losses = rank["losses"]
        assert len(losses) == epochs * samples // 2 // 16
        first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
        assert last < 0.5 * first, f"rank {rank['rank']}: loss {first:.3f} -> {last:.3f}"

        reads = Counter(int(line) for line in (tmp_path / f"reads.rank{rank['rank']}").read_text().split())
        sampler = DistributedSampler(range(samples), num_replicas=2, rank=rank["rank"], shuffle=True, seed=0)
        planned = set()
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            planned |= set(sampler)
        assert set(reads) == planned, "read a sample outside the rank's shards, or missed one"
        assert max(reads.values()) == 1, "a cached sample was read from storage again"
        assert rank["stats"]["storage_reads"] == len(planned)
        assert rank["stats"]["samples"] == epochs * samples // 2
    assert "epoch 2: loss" in stdout


@pytest.mark.slow
def test_two_nodes_with_their_own_disks_as_the_kubernetes_job_runs_them(tmp_path):
    """What job.yaml does on 2 pods: torchrun --nnodes 2, one rank per node, node 0 hosts the rendezvous,
    each node with its own (empty) data directory."""
    port = free_port()
    procs = []
    for node in range(2):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            SCRIPT,
            "--data",
            str(tmp_path / f"node{node}" / "data"),
            "--samples",
            "64",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--out",
            str(tmp_path / "out"),
        ]
        procs.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                start_new_session=True,
            )
        )
    try:
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    for node in range(2):
        assert len(list((tmp_path / f"node{node}" / "data").rglob("*.pgm"))) == 64
        result = json.loads((tmp_path / "out" / f"rank{node}.json").read_text())
        assert result["world"] == 2 and result["stats"]["samples"] == 32
