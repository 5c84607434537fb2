"""Four real ranks (processes started as torchrun starts them, see forked_ranks.py; gloo on CPU)
sharing their caches: storage is read once per sample over a run when the caches together hold
the dataset; a rank that is killed or stopped makes the others take its samples from storage
within peer_timeout, log which rank it was, and finish with torch's batches (each rank compares
with torch's DataLoader over the same DistributedSampler in its own process, see ranks_run.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from loader.peers.model import traffic
from tests.loader.conftest import SAMPLE_BYTES, write_files

pytestmark = pytest.mark.slow  # real ranks, each a process

RANKS = 4


def launch(mode: str, root: str, out, arg, ranks: int = RANKS, then: tuple = ()):
    """`ranks` ranks of ranks_run.py in MODE; the launcher waits for all of them (a killed one too).
    `then`: (MODE, ROOT, OUT, ARG, RANKS) of a second run under the same launcher, after the first."""
    command = [sys.executable, "-m", "tests.loader.forked_ranks", str(ranks), "tests.loader.ranks_run"]
    command += [mode, root, str(out), str(arg)]
    if then:
        *words, count = then
        command += ["--", str(count), "tests.loader.ranks_run", *map(str, words)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        command,
        cwd=os.getcwd(),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(paths, proc, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(
                f"no result from {[p.name for p in paths if not p.exists()]}:\n{proc.communicate()[0][-4000:]}"
            )
        time.sleep(0.2)


def results(out, ranks) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


def test_four_ranks_read_storage_once_per_sample(tmp_path, out):
    n = 96
    root = write_files(tmp_path / "data", n)
    proc = launch("reads", root, out, 3)
    log = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0, log[-4000:]
    ranks = results(out, range(RANKS))
    assert all(r["same"] for r in ranks), "batches differ from torch's"
    per_epoch = [sum(r["reads"][e] for r in ranks) for e in range(3)]
    assert sum(per_epoch) <= 1.05 * n, per_epoch
    assert per_epoch[1:] == [0, 0], "epochs 2 and 3 come from the ranks' caches"
    assert all(r["peer_reads"] > 0 for r in ranks)
    # the plan's model (no data, no processes) predicts these storage reads, and bounds the peer reads
    model = traffic(n, SAMPLE_BYTES, RANKS, int(1.15 * n / RANKS * SAMPLE_BYTES), 3, seed=5)
    assert per_epoch == [e.storage_reads for e in model]
    assert sum(r["peer_reads"] for r in ranks) <= sum(e.peer_reads for e in model)


def test_a_killed_rank_leaves_the_others_to_storage_then_they_regroup(tmp_path, out):
    root = write_files(tmp_path / "data", 96)
    victim = 2
    proc = launch("kill", root, out, victim)
    survivors = [r for r in range(RANKS) if r != victim]
    wait_for([out / f"rank{r}.json" for r in survivors], proc)
    log = proc.communicate(timeout=60)[0]
    assert not (out / f"rank{victim}.json").exists()
    ranks = results(out, survivors)
    for rank in ranks:
        assert rank["same"], f"rank {rank['rank']}: batches differ from torch's"
        assert rank["peers_lost"] and f"rank {victim} stopped answering" in rank["peers_lost"], rank
        assert rank["reads"][1] > 0, "the rest of epoch 2 came from storage"
        assert rank["peer_reads_per_epoch"][2] > 0, "the survivors exchange again in epoch 3"
        assert rank["peer_failures"] == 1
    # epoch 3: only the lost rank's samples (a quarter of the data) are read again, by their new homes
    assert 0 < sum(r["reads"][2] for r in ranks) <= 96 // RANKS, [r["reads"] for r in ranks]
    assert f"rank {victim} stopped answering" in log  # logged, not only recorded


def test_a_stopped_rank_is_waited_for_only_peer_timeout(tmp_path, out):
    root = write_files(tmp_path / "data", 192)
    stalled = 1
    proc = launch("stall", root, out, stalled)
    wait_for([out / "stopped.pid"], proc)
    pid = int((out / "stopped.pid").read_text())
    others = [r for r in range(RANKS) if r != stalled]
    wait_for([out / f"rank{r}.json" for r in others], proc, seconds=60)  # while it is still stopped
    os.kill(pid, signal.SIGCONT)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log[-4000:]
    ranks = results(out, range(RANKS))
    assert all(r["same"] for r in ranks), "batches differ from torch's"
    for rank in ranks:
        if rank["rank"] != stalled:
            assert f"rank {stalled} stopped answering" in rank["peers_lost"], rank
    assert "had already left the exchange" in ranks[stalled]["peers_lost"]


def test_elastic_resume_from_four_ranks_to_two(out):
    """A checkpoint of 4 ranks, 2 batches into the epoch, resumed by 2 ranks: every sample of the
    epoch is yielded exactly once over both runs, and the next epoch is torch's for 2 ranks."""
    n = 65  # 4 ranks pad it to 68; the 33 samples left split 17 + 16 (3 and 2 exchange windows of 8)
    # the 4 ranks save, then (in the same launcher, with a new store) 2 ranks resume
    proc = launch("save", str(n), out, 2, then=("resume", str(n), out, out / "rank0.pt", 2))
    log = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0, log[-4000:]
    saved = results(out, range(RANKS))
    resumed = [json.loads((out / f"resumed{r}.json").read_text()) for r in range(2)]
    everything = [i for r in saved + resumed for i in r["seen"]]
    assert sorted(everything) == list(range(n)), "a sample was skipped or repeated"
    assert sum(len(r["seen"]) for r in saved) == RANKS * 2 * 4
    assert all(r["next_epoch_is_torchs"] for r in resumed)
    assert [len(r["seen"]) for r in resumed] == [17, 16]
    assert [r["peers_lost"] for r in resumed] == [None, None], "exchange windows did not pair up"
