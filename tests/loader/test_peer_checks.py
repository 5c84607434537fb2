"""A peer that sends bad data is a lost peer: three real ranks (forked_ranks.py, gloo on CPU), one of
them made faulty by a test hook in its rank script (ranks_run.py): its payload is flipped
after the checksums were taken, or it serves samples longer than the dataset's files. The
others refuse its bytes (CRC-32, the dataset's sizes), take the window's samples from
storage, name it, and at the next epoch regroup without it; every rank's batches equal
torch's DataLoader over the same DistributedSampler."""

from __future__ import annotations

import json
import sys

import pytest

from tests.loader.conftest import write_files
from tests.loader.forked_ranks import launcher_output, run_logs

pytestmark = pytest.mark.slow  # starts real ranks, each a process

RANKS = 3
FAULTY = 1
MODES = ("corrupt", "padded", "huge")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict] | None, str]]:
    """The three faulty-peer runs, one after another under one launcher (one import of torch):
    per mode, its ranks' results (None if one is missing) and its log."""
    tmp = tmp_path_factory.mktemp("peer_checks")
    root = write_files(tmp / "data", 96)
    command = [sys.executable, "-m", "tests.loader.forked_ranks"]
    for mode in MODES:
        (tmp / mode).mkdir()
        command += [str(RANKS), "tests.loader.ranks_run", mode, root, str(tmp / mode), str(FAULTY), "--"]
    log = launcher_output(command, timeout=600)
    logs = dict(zip(MODES, run_logs(log) + [log] * len(MODES)))
    results = {}
    for mode in MODES:
        files = [tmp / mode / f"rank{r}.json" for r in range(RANKS)]
        ranks = [json.loads(f.read_text()) for f in files] if all(f.exists() for f in files) else None
        results[mode] = ranks, logs[mode]
    return results


def run(runs, mode: str) -> tuple[list[dict], str]:
    ranks, log = runs[mode]
    assert ranks is not None and "ended with" not in log, log[-4000:]
    assert all(r["same"] for r in ranks), "a bad peer's bytes reached a batch"
    return ranks, log


@pytest.mark.parametrize(
    "mode, why",
    [
        ("corrupt", "do not match their CRC-32"),
        ("padded", "which must be 64 (the dataset's size)"),
    ],
    ids=["payload_flipped_by_test_hook", "samples_padded_by_test_hook"],
)
def test_a_peer_sending_bad_data_is_dropped_like_a_lost_peer(runs, mode, why):
    ranks, log = run(runs, mode)
    for rank in ranks:  # all name it in the same window, the faulty rank too
        assert rank["peers_lost"] and f"rank {FAULTY} sent bad data" in rank["peers_lost"], rank
        assert why in rank["peers_lost"] and rank["peer_failures"] == 1, rank
    # epoch 3: the honest ranks exchange again, without the faulty one, which reads storage alone
    honest = [r for r in ranks if r["rank"] != FAULTY]
    assert all(r["peer_reads_per_epoch"][2] > 0 for r in honest), [r["peer_reads_per_epoch"] for r in ranks]
    assert ranks[FAULTY]["peer_reads_per_epoch"][2] == 0
    assert "exchanging with ranks [0, 2]" in log


def test_a_peer_padded_past_its_caches_by_test_hook_is_refused_before_allocating(runs):
    """A test hook pads the faulty rank's samples by 1 MiB, more than a rank can hold (its arena and
    disk tier: a few KiB here): its receivers leave at the sizes phase, without allocating, and the
    others find it named in the store when their next phase times out."""
    ranks, _ = run(runs, "huge")
    for rank in ranks:
        if rank["rank"] != FAULTY:
            assert rank["peers_lost"] and f"rank {FAULTY} sent bad data" in rank["peers_lost"], rank
    assert any("more than a peer can hold (" in (r["peers_lost"] or "") for r in ranks)
