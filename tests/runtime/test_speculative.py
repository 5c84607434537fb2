"""Speculative decoding through the engine, on tiny random models: outputs are those without it.

The oracle is the same engine's model without speculation. Two proposers drive the verification: the
real n-gram proposer, and a test proposer that knows the reference output and proposes it with one token
in three corrupted, so that every step accepts some proposals and rejects others (a random model's own
output rarely repeats enough for n-gram proposals to be accepted).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.sample.rejection_sampler import target_probs, verify
from tests.random_families import hf_model, save_hf_dir
from tests.random_llama import TINY, engine_for, hf_llama

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 1000,  # proposals at every batch size: the tests check several streams
}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = hf_llama(TINY, seed=3)
    return engine_for(hf, tmp_path_factory.mktemp("spec"), torch.float32, "cpu", num_blocks=256)


def variant(base: Engine, **kw) -> Engine:
    kw.setdefault("num_blocks", 256)
    return every_proposal_pays(Engine(base.model, base.tokenizer, **kw))


def every_proposal_pays(engine: Engine) -> Engine:
    """Proposals at every batch size and rate (no step-cost model): the tests check verification."""
    if engine.speculator is not None:
        engine.speculator.row_cost = 0.0
    return engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so the n-gram proposer finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 200) for _ in range(rng.randrange(5, 12))]
        out.append(phrase * 3 + phrase[:3])
    return out


def oracle(engine: Engine, reference: dict[tuple, list[int]], k: int = 4, wrong_every: int = 3) -> Engine:
    """Make the engine's speculator propose the reference continuation, every wrong_every-th token wrong."""
    spec = engine.speculator

    def propose(request, state):
        truth = reference[tuple(request.prompt_token_ids)]
        at = request.num_output_tokens
        drafts = list(truth[at : at + k])
        for i in range(len(drafts)):
            if (at + i) % wrong_every == wrong_every - 1:
                drafts[i] = (drafts[i] + 1) % engine.vocab_size
        return drafts

    spec._propose = propose
    return every_proposal_pays(engine)


def run(engine: Engine, ps, params):
    return engine.generate(ps, params)


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text and x.finish_reason == y.finish_reason and x.stop_reason == y.stop_reason


def assert_no_leaks(engine: Engine):
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_is_lossless_at_one_and_several_streams(tiny, caching):
    ps = prompts(6)
    base = variant(tiny, enable_prefix_caching=caching)
    want = run(base, ps, GREEDY)
    spec = variant(tiny, enable_prefix_caching=caching, speculative_config=NGRAM)
    assert_same(run(spec, ps, GREEDY), want)
    assert_same(run(spec, ps[:1], GREEDY), want[:1])
    assert spec.stats().spec_num_drafts > 0
    reference = {tuple(p): o.token_ids for p, o in zip(ps, want)}
    spec = oracle(variant(tiny, enable_prefix_caching=caching, speculative_config=NGRAM), reference)
    assert_same(run(spec, ps + ps[:2], GREEDY), want + want[:2])  # repeats: prefix-cache hits
    stats = spec.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_no_leaks(spec)


def test_verifying_rows_run_as_decode_rows(tiny, monkeypatch):
    """A sequence verifying k proposals is k + 1 decode rows (no prefill chunk), beside plain decodes, with
    the same greedy tokens as without speculation and as verification through a prefill chunk."""
    ps = prompts(4, seed=8)
    want = run(variant(tiny), ps, GREEDY)
    reference = {tuple(p): o.token_ids for p, o in zip(ps, want)}
    spec = oracle(variant(tiny, speculative_config=NGRAM), reference)
    steps = []
    build = type(spec.runner.attention).build

    def recorded(self, decodes, prefills, *args):
        steps.append(([d.end - d.start for d in decodes], len(prefills)))
        return build(self, decodes, prefills, *args)

    monkeypatch.setattr(type(spec.runner.attention), "build", recorded)
    assert_same(run(spec, ps, GREEDY), want)
    decoding = [(rows, chunks) for rows, chunks in steps if rows]
    assert all(rows == [1] * len(rows) for rows, _ in decoding)
    # some steps verify several sequences' proposals (more decode rows than sequences) without a chunk
    assert any(len(rows) > 4 and chunks == 0 for rows, chunks in decoding)
    monkeypatch.setattr(type(spec.runner), "verify_as_decode", False)
    chunked = oracle(variant(tiny, speculative_config=NGRAM), reference)
    assert_same(run(chunked, ps, GREEDY), want)


@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma3", "phi3"])
def test_greedy_is_lossless_for_each_family(family, tmp_path_factory):
    path = save_hf_dir(hf_model(family), tmp_path_factory.mktemp(family))
    base = Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
    ps = prompts(3, seed=1)  # longer than mistral's sliding window and the 32-token original contexts
    want = run(base, ps, GREEDY)
    reference = {tuple(p): o.token_ids for p, o in zip(ps, want)}
    spec = oracle(
        Engine(base.model, base.tokenizer, kv_cache_bytes=4 << 20, speculative_config=NGRAM), reference
    )
    assert_same(run(spec, ps, GREEDY), want)
    assert spec.stats().spec_num_accepted_tokens > 0


def test_penalties_logit_bias_min_tokens_and_n_still_hold(tiny):
    ps = prompts(3, seed=2)
    params = [
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(max_tokens=20, temperature=0, logit_bias={5: 4.0, 9: 3.0}, presence_penalty=0.5),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=12, n=2, stop_token_ids=[7, 11]),
    ]
    base = variant(tiny)
    want = run(base, ps, params)
    # the oracle for n = 2 proposes sequence 0's output to both sequences (equal under greedy)
    reference = {tuple(p): o.token_ids for p, o in zip(ps, [want[0], want[1], want[2]])}
    spec = oracle(variant(tiny, speculative_config=NGRAM), reference)
    assert_same(run(spec, ps, params), want)
    assert spec.stats().spec_num_accepted_tokens > 0


def test_stop_strings_and_ids_inside_an_accepted_run(tiny):
    (p,) = prompts(1, seed=4)
    base = variant(tiny)
    free = run(base, [p], GREEDY)[0]
    reference = {tuple(p): free.token_ids}
    # every proposal right: steps give 5 tokens (1-5, 6-10, ..): a stop at token 8 is inside a run
    word = base.tokenizer.decode([free.token_ids[8]])
    stop_id = free.token_ids[8]
    cases = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[word]),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
    ]
    for params in cases:
        want = run(base, [p], params)
        spec = oracle(variant(tiny, speculative_config=NGRAM), reference, wrong_every=10**9)
        got = run(spec, [p], params)
        assert_same(got, want)
        assert len(got[0].token_ids) <= 9 and got[0].finish_reason == "stop"
        assert spec.stats().spec_num_accepted_tokens >= 4
        assert spec.stats().generated_tokens == len(got[0].token_ids)
        assert_no_leaks(spec)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_are_those_of_the_emitted_tokens(tiny, mode):
    ps = prompts(2, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3, logprobs_mode=mode)
    want = run(variant(tiny), ps, params)
    reference = {tuple(p): o.token_ids for p, o in zip(ps, want)}
    got = run(oracle(variant(tiny, speculative_config=NGRAM), reference), ps, params)
    for x, y in zip(got, want):
        assert x.token_ids == y.token_ids and len(x.logprobs) == len(y.logprobs) == 16
        for a, b in zip(x.logprobs, y.logprobs):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_preemption_under_a_tiny_pool(tiny):
    ps = prompts(4, seed=6)
    want = run(variant(tiny), ps, GREEDY)
    reference = {tuple(p): o.token_ids for p, o in zip(ps, want)}
    longest = max(len(p) for p in ps) + GREEDY.max_tokens
    blocks = -(-longest // tiny.kv.block_size) + 2
    spec = oracle(variant(tiny, num_blocks=blocks, speculative_config=NGRAM), reference)
    assert_same(run(spec, ps, GREEDY), want)
    assert spec.stats().num_preemptions > 0
    assert_no_leaks(spec)


def test_streaming_deltas_carry_several_tokens(tiny):
    (p,) = prompts(1, seed=7)
    want = run(variant(tiny), [p], GREEDY)[0]
    spec = oracle(variant(tiny, speculative_config=NGRAM), {tuple(p): want.token_ids}, wrong_every=10**9)
    spec.add_request("s", p, GREEDY)
    deltas = []
    while spec.has_unfinished_requests():
        deltas += spec.step()
    assert max(len(d.new_token_ids) for d in deltas) == 5
    assert [t for d in deltas for t in d.new_token_ids] == want.token_ids
    assert "".join(d.new_text for d in deltas) == want.text


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at upper tail ~0.001 (z = 3.09), by Wilson and Hilferty's approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_rejection_sampling_draws_from_the_target_distribution():
    """Each emitted token is distributed as the target row's p (an exact oracle: softmax of the logits)."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 20000
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    p = target_probs(logits, [params] * 3)
    drafts = [int(p[0].argmax()), int(p[1].argmin())]  # one likely proposal, one the top-k cuts
    rows = logits.repeat(n, 1)
    out = verify(rows, [3 * i for i in range(n)], [drafts] * n, [params] * n, [None] * n)
    first = Counter(o[0] for o in out)
    second = Counter(o[1] for o in out if len(o) > 1 and o[0] == drafts[0])
    for counts, probs in ((first, p[0]), (second, p[1])):
        total = sum(counts.values())
        stat = sum(
            (counts.get(t, 0) - total * float(q)) ** 2 / (total * float(q))
            for t, q in enumerate(probs)
            if q > 0
        )
        assert stat < chi_square_critical(int((probs > 0).sum()) - 1), (counts, probs)
        assert all(probs[t] > 0 for t in counts)  # nothing outside top-k
    assert all(len(o) <= 2 for o in out)  # the second proposal (cut by top-k) is never accepted


def test_sampled_next_tokens_cannot_tell_speculation_from_none(tiny):
    """Temperature 1: the counts of the 2nd and 3rd generated tokens over many samples, with and without
    speculation (proposals from the greedy output, so some are accepted): a two-sample chi-square test."""
    (p,) = prompts(1, seed=8)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    greedy = run(variant(tiny), [p], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    n = 800
    base = variant(tiny, max_num_seqs=64)
    spec = oracle(
        variant(tiny, max_num_seqs=64, speculative_config=NGRAM),
        {tuple(p): greedy.token_ids},
        k=2,
        wrong_every=10**9,
    )
    a = run(base, [p] * n, params)
    b = run(spec, [p] * n, params)
    assert spec.stats().spec_num_accepted_tokens > n // 10
    assert spec.stats().spec_num_accepted_tokens < spec.stats().spec_num_draft_tokens
    for position in (1, 2):
        ca = Counter(o.token_ids[position] for o in a)
        cb = Counter(o.token_ids[position] for o in b)
        tokens = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
        stat = sum((ca[t] - cb[t]) ** 2 / (ca[t] + cb[t]) for t in tokens)  # equal sample sizes
        assert stat < chi_square_critical(len(tokens) - 1), (position, ca, cb)


def test_suffix_method_is_lossless_and_learns_from_the_tenants_earlier_requests(tiny):
    ps = prompts(3, seed=9)
    want = run(variant(tiny), ps, GREEDY)
    spec = variant(
        tiny, speculative_config={"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 9}
    )
    assert_same(run(spec, ps, GREEDY), want)
    first = spec.stats().spec_num_accepted_tokens
    assert_same(run(spec, ps, GREEDY), want)  # again: the tenant's store now holds these outputs
    assert spec.stats().spec_num_accepted_tokens - first > first


def test_draft_model_with_the_same_vocabulary_is_lossless_and_others_are_refused(tmp_path):
    target = save_hf_dir(hf_model("llama3"), tmp_path / "target")
    base = Engine.from_pretrained(str(target), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
    ps = prompts(3, seed=10)
    want = run(base, ps, GREEDY)
    draft = {
        "method": "draft_model",
        "model": str(target),
        "num_speculative_tokens": 4,
        "disable_by_batch_size": 9,
    }
    spec = Engine(base.model, base.tokenizer, kv_cache_bytes=4 << 20, speculative_config=draft)
    assert_same(run(spec, ps, GREEDY), want)
    stats = spec.stats()  # its own copy as the draft: every proposal is the target's greedy token
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    other = save_hf_dir(hf_model("llama3", vocab_size=300), tmp_path / "other")
    with pytest.raises(ValueError, match="speculative_config.model: the draft model .* does not share"):
        Engine(
            base.model,
            base.tokenizer,
            kv_cache_bytes=4 << 20,
            speculative_config=draft | {"model": str(other)},
        )
