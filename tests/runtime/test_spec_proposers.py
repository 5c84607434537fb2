"""The proposers alone: prompt lookup finds the latest recurrence of the longest suffix; the suffix store
proposes from a tenant's own recent requests and never from another tenant's; backoff and batch size."""

from __future__ import annotations

from runtime.spec_decode import SpeculativeConfig, Speculator
from runtime.spec_decode.ngram import NgramIndex
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
    for _ in range(3):  # the running rate (1, then halved each time) falls below min_acceptance_rate
        spec.observe("r", 3, 0)
    r.spec_token_ids = []
    spec.propose([r])
    assert r.spec_token_ids == []
    many = [request(f"m{i}", [1, 2, 3, 1, 2], output=[3]) for i in range(3)]
    spec.propose(many)
    assert all(m.spec_token_ids == [] for m in many)
