"""The proposers alone: prompt lookup finds the latest recurrence of the longest suffix; the suffix store
proposes from a tenant's own recent requests and never from another tenant's; backoff and batch size."""

from __future__ import annotations

from runtime.spec_decode import SpeculativeConfig, Speculator
from runtime.spec_decode.ngram import NgramIndex
from runtime.spec_decode.speculator import ROW_COST, proposal_count
from runtime.spec_decode.suffix import SuffixStore
from scheduler import Request, SamplingParams


def request(rid: str, prompt: list[int], tenant: str = "a", output: list[int] = ()) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=50), tenant=tenant)
    for t in output:
        r.append_output_token(t)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7])
    assert index.propose_matched(3) == (3, [8, 9, 6])  # 5 6 7 recurs once, followed by 8 9 6
    index.extend([1])
    assert index.propose(4) == [2, 5, 6, 7]  # 6 7 1 -> its only earlier occurrence
    index.extend([42])
    assert index.propose(4) == []


def test_suffix_store_serves_a_tenant_its_own_history_only():
    store = SuffixStore(max_depth=8, max_requests=2)
    done = request("old", [1, 2, 3, 10, 11, 12, 13, 14], tenant="a")
    store.add(done)
    mine = request("new", [7, 7, 10, 11], tenant="a")
    theirs = request("other", [7, 7, 10, 11], tenant="b")
    own = NgramIndex(2, 8)
    own.sync(mine.all_token_ids)
    assert store.propose(mine, own, 3, 0.1) == [12, 13, 14]
    other = NgramIndex(2, 8)
    other.sync(theirs.all_token_ids)
    assert store.propose(theirs, other, 3, 0.1) == []
    for i in range(2):  # bounded: the oldest request is dropped
        store.add(request(f"r{i}", [50 + i, 51 + i, 52 + i], tenant="a"))
    assert store.propose(mine, own, 3, 0.1) == []


def test_backoff_after_rejections_and_no_proposals_in_a_large_batch():
    spec = Speculator(SpeculativeConfig(method="ngram", prompt_lookup_min=1, disable_by_batch_size=3))
    r = request("r", [1, 2, 3, 1, 2], output=[3])
    spec.propose([r])
    assert r.spec_token_ids == [1, 2, 3]
    for _ in range(3):  # the running rate (0.8, then halved each time) falls below where one pays
        spec.observe("r", 3, 0)
    r.spec_token_ids = []
    spec.propose([r])
    assert r.spec_token_ids == []
    many = [request(f"m{i}", [1, 2, 3, 1, 2], output=[3]) for i in range(3)]
    spec.propose(many)
    assert all(m.spec_token_ids == [] for m in many)


def test_proposals_per_request_follow_its_acceptance_and_the_batch():
    # the step-time model: one more row costs ROW_COST of a one-row step; the count maximises tokens per
    # unit of time, checked here against an exhaustive search written out by hand
    def best(rate, batch, most, cost=ROW_COST):
        per_time = [
            (batch - 1 + sum(rate**i for i in range(d + 1))) / (1 + cost * (batch - 1 + d))
            for d in range(most + 1)
        ]
        return max(range(most + 1), key=lambda d: (per_time[d], -d))

    for batch in (1, 2, 8, 32):
        counts = [proposal_count(a / 20, batch - 1, batch - 1, 5) for a in range(21)]
        assert counts == [best(a / 20, batch, 5) for a in range(21)]
        assert counts == sorted(counts)  # more accepted: more proposed
    assert proposal_count(0.95, 0, 0, 5) == 5 and proposal_count(0.1, 0, 0, 5) == 0
    assert proposal_count(0.8, 31, 31, 5) == 0  # a full batch: one more row costs more than it gives
    # a lone copying request proposes all it may; one mostly rejected, fewer, then none for a while, then
    # probes with one
    spec = Speculator(SpeculativeConfig(method="ngram", prompt_lookup_min=1, num_speculative_tokens=4))
    r = request("r", [1, 2, 3, 4, 5, 6] * 3 + [1], output=[2])
    spec.propose([r])
    assert r.spec_token_ids == [3, 4, 5, 6]
    spec.observe("r", 4, 2)
    r.spec_token_ids = []
    spec.propose([r])
    assert 0 < len(r.spec_token_ids) < 4
    for _ in range(4):
        spec.observe("r", 1, 0)
    proposed = []
    for _ in range(6):
        r.spec_token_ids = []
        spec.propose([r])
        proposed.append(len(r.spec_token_ids))
    assert proposed[0] == 0 and 1 in proposed
