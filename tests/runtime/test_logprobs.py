"""Logprobs of prompt and generated tokens against transformers' float32 logits, and the logit edits
(logit_bias, min_tokens) that requests ask for."""

from __future__ import annotations

import pytest
import torch

from runtime import SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog. Log-likelihood evaluation scores every token of a "
    "fixed text, so chunked prefill must give the same numbers as one pass."
)


@torch.no_grad()
def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("chunk", [512, 16])
def test_prompt_logprobs_equal_transformers(engine_fp32, reference, chunk):
    _, model = reference
    ids = engine_fp32.tokenizer.encode(TEXT)
    config = engine_fp32.scheduler.config
    saved, config.max_num_batched_tokens = config.max_num_batched_tokens, chunk
    try:
        engine_fp32.generate(
            [TEXT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
        )  # cache it
        out = engine_fp32.generate([TEXT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    finally:
        config.max_num_batched_tokens = saved
    assert out.num_cached_tokens == 0  # the prefix cache keeps no logits: the prompt is recomputed
    ref = _reference_logprobs(model, ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        score = out.prompt_logprobs[pos]
        assert score.token_id == ids[pos]
        assert abs(score.logprob - ref[pos - 1, ids[pos]].item()) < 1e-3, pos
        top = ref[pos - 1].topk(3)
        assert [t for t, _ in score.top] == top.indices.tolist()
        assert score.rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1


def test_generated_logprobs_equal_transformers(engine_fp32, reference):
    _, model = reference
    ids = engine_fp32.tokenizer.encode("The capital of France is")
    out = engine_fp32.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    ref = _reference_logprobs(model, ids + out.token_ids[:-1])
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, score) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert score.token_id == token and score.rank == 1
        assert abs(score.logprob - row[token].item()) < 1e-3
        assert [t for t, _ in score.top] == row.topk(2).indices.tolist()


def test_logit_bias_forces_a_token_and_raw_logprobs_ignore_it(engine_fp32):
    forced = engine_fp32.tokenizer.encode(" banana")[0]
    prompt = "The capital of France is"
    plain = engine_fp32.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=0))[0]
    raw = engine_fp32.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=0, logit_bias={forced: 100})
    )[0]
    processed = engine_fp32.generate(
        [prompt],
        SamplingParams(
            max_tokens=3, temperature=0, logprobs=0, logit_bias={forced: 100}, logprobs_mode="processed"
        ),
    )[0]
    assert raw.token_ids == [forced] * 3 == processed.token_ids
    assert plain.token_ids[0] != forced and raw.logprobs[0].logprob < plain.logprobs[0].logprob - 1
    assert processed.logprobs[0].logprob > -1e-3  # after the bias the token is all but certain


def test_min_tokens_holds_back_stop_tokens(engine_fp32):
    prompt = "Count: one, two, three, four, five,"
    plain = engine_fp32.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    stop = plain[1]
    short = engine_fp32.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop])
    )[0]
    assert short.token_ids == plain[:2] and short.finish_reason == "stop"
    held = engine_fp32.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=6)
    )[0]
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]
