"""A peer that sends bad data is a lost peer: three real ranks (torchrun, gloo on CPU), one of
them made faulty by a test hook in its rank script (ranks_run.py): its payload is flipped
after the checksums were taken, or it serves samples longer than the dataset's files. The
others refuse its bytes (CRC-32, the dataset's sizes), take the window's samples from
storage, name it, and at the next epoch regroup without it; every rank's batches equal
torch's DataLoader over the same DistributedSampler."""

from __future__ import annotations

import pytest

from tests.loader.conftest import write_files
from tests.loader.test_ranks import results, torchrun

pytestmark = pytest.mark.slow  # starts torchrun ranks

RANKS = 3
FAULTY = 1


def run(tmp_path, mode: str) -> tuple[list[dict], str]:
    out = tmp_path / "out"
    out.mkdir()
    root = write_files(tmp_path / "data", 96)
    proc = torchrun(mode, root, out, FAULTY, ranks=RANKS)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-4000:]
    ranks = results(out, range(RANKS))
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
def test_a_peer_sending_bad_data_is_dropped_like_a_lost_peer(tmp_path, mode, why):
    ranks, log = run(tmp_path, mode)
    for rank in ranks:  # all name it in the same window, the faulty rank too
        assert rank["peers_lost"] and f"rank {FAULTY} sent bad data" in rank["peers_lost"], rank
        assert why in rank["peers_lost"] and rank["peer_failures"] == 1, rank
    # epoch 3: the honest ranks exchange again, without the faulty one, which reads storage alone
    honest = [r for r in ranks if r["rank"] != FAULTY]
    assert all(r["peer_reads_per_epoch"][2] > 0 for r in honest), [r["peer_reads_per_epoch"] for r in ranks]
    assert ranks[FAULTY]["peer_reads_per_epoch"][2] == 0
    assert "exchanging with ranks [0, 2]" in log


def test_a_peer_padded_past_its_caches_by_test_hook_is_refused_before_allocating(tmp_path):
    """A test hook pads the faulty rank's samples by 1 MiB, more than a rank can hold (its arena and
    disk tier: a few KiB here): its receivers leave at the sizes phase, without allocating, and the
    others find it named in the store when their next phase times out."""
    ranks, _ = run(tmp_path, "huge")
    for rank in ranks:
        if rank["rank"] != FAULTY:
            assert rank["peers_lost"] and f"rank {FAULTY} sent bad data" in rank["peers_lost"], rank
    assert any("more than a peer can hold (" in (r["peers_lost"] or "") for r in ranks)
