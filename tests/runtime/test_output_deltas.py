"""Each engine step hands over only what is new: its cost does not grow with the output's length, and the
deltas assembled give back exactly what the engine generated (the scheduler's own token list and one decode
of it are the oracle), through stop strings, logprobs, n > 1 and preemption."""

from __future__ import annotations

from runtime import Engine, RequestOutput, SamplingParams


class CountingTokenizer:
    """The engine's tokenizer, counting the token ids each decode call is given (the detokenizer's work)."""

    def __init__(self, inner):
        self.inner = inner
        self.decoded = 0

    def decode(self, ids, *args, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(engine: Engine, requests: dict[str, SamplingParams], prompt: str) -> tuple[dict, list[int], list]:
    """Step until done; returns assembled outputs by (id, index), the items handed over per step, and the
    engine's Request objects (the truth to compare with)."""
    seqs = {}
    for rid, params in requests.items():
        req = engine.add_request(rid, prompt, params)
        seqs.update({(rid, s.index): s for s in [req, *req.forks]})
    outs = {key: RequestOutput(key[0], seq.prompt_token_ids, index=key[1]) for key, seq in seqs.items()}
    per_step = []
    while engine.has_unfinished_requests():
        deltas = engine.step()
        per_step.append(
            max(
                (
                    len(d.new_token_ids)
                    + len(d.new_token_times)
                    + len(d.new_logprobs or ())
                    + len(d.new_text)
                    for d in deltas
                ),
                default=0,
            )
        )
        for d in deltas:
            outs[d.request_id, d.index].append(d)
    return outs, per_step, seqs


def test_step_work_does_not_grow_with_the_output(engine_fp32):
    engine = Engine(engine_fp32.model, engine_fp32.tokenizer, num_blocks=128, block_size=16)
    counting = CountingTokenizer(engine.tokenizer)
    engine.tokenizer = counting
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, logprobs=1, stop=["never-seen"])
    engine.add_request("long", "Write a long story about a lighthouse keeper.", params)
    handed, decoded = [], []
    out = None
    while engine.has_unfinished_requests():
        before = counting.decoded
        for d in engine.step():
            out = out or RequestOutput("long", [], index=0)
            out.append(d)
            handed.append(len(d.new_token_ids) + len(d.new_token_times) + len(d.new_logprobs or ()))
        decoded.append(counting.decoded - before)
    assert len(out.token_ids) == 120 and out.finished
    # one token, its time and its logprob per step, at token 10 as at token 110
    assert max(handed[:15]) == max(handed[-15:]) == 3
    # the detokenizer decodes a short window, not the whole output
    assert max(decoded[-15:]) <= max(decoded[1:16]) + 8
    assert len(out.text) > 100 and out.text == engine_fp32.tokenizer.decode(out.token_ids)


def test_deltas_assemble_to_what_the_engine_generated_through_preemption(engine_fp32):
    # A pool too small for all of them at once: decodes growing into new blocks preempt and recompute.
    engine = Engine(engine_fp32.model, engine_fp32.tokenizer, num_blocks=14, block_size=8, max_num_seqs=6)
    requests = {
        f"r{i}": SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True, logprobs=1)
        for i in range(4)
    }
    requests["forks"] = SamplingParams(max_tokens=24, temperature=0.8, seed=9, n=2, ignore_eos=True)
    requests["stopped"] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[" the", "\n"])
    outs, per_step, seqs = _run(engine, requests, "Once upon a time in a quiet village,")
    assert engine.stats()["num_preemptions"] > 0
    tok = engine_fp32.tokenizer
    for key, out in outs.items():
        truth = seqs[key]
        assert out.finished and out.token_ids == truth.output_token_ids, key
        assert len(out.token_times) == len(out.token_ids)
        assert out.token_times == sorted(out.token_times)
        if truth.sampling_params.logprobs is not None:
            assert [s.token_id for s in out.logprobs] == out.token_ids
        text = tok.decode(out.token_ids)
        if key[0] == "stopped" and out.stop_reason is not None:
            assert text.startswith(out.text) and text[len(out.text) :].startswith(out.stop_reason)
        else:
            assert out.text == text, key
    assert max(per_step) < 40  # a handful of tokens' worth per delta, never the whole output
