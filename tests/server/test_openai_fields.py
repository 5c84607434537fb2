"""The OpenAI fields evaluation harnesses and SDK users send (batched prompts, echo, logprobs, logit_bias,
min_tokens), through the official openai client, sync and async, streaming and not."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from runtime import SamplingParams
from tests.server.conftest import MODEL

TEXT = "Paris is the capital and most populous city of France, on the river Seine."


@pytest.fixture(scope="module")
def transformers_model(transformers_dir):
    """transformers loading the GGUF itself (saved once per run in its own format, tests/conftest.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(transformers_dir, dtype=torch.float32)
    return model.eval()


def test_echo_with_max_tokens_0_ends_by_its_limit(client, offline_engine):
    """Scoring a prompt (echo, max_tokens 0) samples one token and drops it; the finish_reason is 'length'
    even when that token is the eos (forced here by logit_bias), streamed or not."""
    eos = offline_engine.tokenizer.eos_token_id
    ask = dict(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=1, logit_bias={str(eos): 100})
    resp = client.completions.create(**ask)
    assert resp.choices[0].text == TEXT and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 0
    chunks = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]


def test_echo_logprobs_is_transformers_log_likelihood(client, offline_engine, transformers_model):
    resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    choice = resp.choices[0]
    ids = offline_engine.tokenizer.encode(TEXT)
    assert choice.text == TEXT and resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert "".join(lp.tokens) == TEXT
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    with torch.no_grad():
        logits = transformers_model(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)
        ).logits
    ref = torch.log_softmax(logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) < 1e-3
        assert lp.tokens[pos] in lp.top_logprobs[pos]


def test_batched_prompts_are_indexed_prompt_major(client, offline_engine):
    prompts = [
        "The capital of France is",
        "One, two, three,",
        offline_engine.tokenizer.encode("Water boils at"),
    ]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    expected = offline_engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [c.text for c in resp.choices] == [e.text for e in expected]
    assert resp.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert resp.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_streamed_batch_with_echo_and_logprobs_assembles(client, offline_engine):
    prompts = ["The capital of France is", "One, two, three,"]
    expected = offline_engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, logprobs=2))
    texts, tokens, finish = ["", ""], [[], []], [None, None]
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, logprobs=2, echo=True, stream=True
    ):
        c = chunk.choices[0]
        texts[c.index] += c.text
        tokens[c.index] += c.logprobs.token_logprobs if c.logprobs else []
        finish[c.index] = c.finish_reason or finish[c.index]
    for i, e in enumerate(expected):
        assert texts[i] == prompts[i] + e.text and finish[i] == e.finish_reason
        generated = tokens[i][len(e.prompt_token_ids) :]
        assert tokens[i][0] is None and len(tokens[i]) == len(e.prompt_token_ids) + len(e.token_ids)
        assert generated == pytest.approx([s.logprob for s in e.logprobs], abs=1e-4)


def test_completions_logprobs_zero_gives_the_chosen_tokens_and_no_alternatives(client, offline_engine):
    prompt = "The sky is"
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=0))[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    lp = resp.choices[0].logprobs
    assert lp is not None, "logprobs: 0 must still return the sampled tokens' logprobs"
    assert lp.token_logprobs == pytest.approx([s.logprob for s in expected.logprobs], abs=1e-4)
    # no alternatives: each position lists only the chosen token, as vLLM's do
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_sync_and_async_streaming(client, server, offline_engine):
    messages = [{"role": "user", "content": "Name a color."}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)

    async def streamed():
        async with server.async_openai_client() as aclient:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=8,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
                stream=True,
            )
            return [
                t
                async for chunk in stream
                if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content
            ]

    got = asyncio.run(streamed())
    assert [t.token for t in got] == [t.token for t in content]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_logit_bias_and_min_tokens_over_http(client, offline_engine):
    forced = offline_engine.tokenizer.encode(" banana")[0]
    resp = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert resp.choices[0].text == " banana" * 3
    resp = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=5,
        temperature=0,
        extra_body={"min_tokens": 5, "stop_token_ids": [forced]},
        logit_bias={str(forced): 100},
    )
    assert resp.usage.completion_tokens == 5 and "banana" not in resp.choices[0].text


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(prompt="Hi", max_tokens=0), "max_tokens"),
        (dict(prompt="Hi", logprobs=21), "logprobs"),
        (dict(prompt=["Hi", 3]), "prompt[1]"),
        (dict(prompt="Hi", logit_bias={"x": 1}), "logit_bias"),
        (dict(prompt="Hi", max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    ],
)
def test_bad_fields_name_the_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, **kwargs)
    assert info.value.body["param"] == param


def test_n_choices_sync_and_async_stream_each_with_its_seed(client, server, offline_engine):
    prompt = "My favourite fruit is"
    resp = client.completions.create(
        model=MODEL, prompt=[prompt, "Hi"], max_tokens=6, temperature=1.0, seed=7, n=3
    )
    assert [c.index for c in resp.choices] == list(range(6))
    alone = [
        offline_engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + j))[0].text
        for j in range(3)
    ]
    assert [c.text for c in resp.choices[:3]] == alone

    async def streamed():
        async with server.async_openai_client() as aclient:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name a fruit."}],
                max_tokens=6,
                temperature=1.0,
                seed=3,
                n=2,
                stream=True,
            )
            texts, finish = ["", ""], [None, None]
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
                    finish[c.index] = c.finish_reason or finish[c.index]
            return texts, finish

    texts, finish = asyncio.run(streamed())
    messages = [{"role": "user", "content": "Name a fruit."}]
    ids = offline_engine.tokenizer.apply_chat_template(messages, tokenize=True)
    for j in range(2):
        expected = offline_engine.generate([ids], SamplingParams(max_tokens=6, temperature=1.0, seed=3 + j))[
            0
        ]
        assert texts[j] == expected.text and finish[j] == expected.finish_reason


def test_best_of_returns_the_most_likely_of_its_samples(client, offline_engine):
    prompt = "My favourite fruit is"
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=21, n=1, best_of=3
    )
    samples = offline_engine.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=21, n=3, logprobs=0)
    )
    best = max(samples, key=lambda o: sum(s.logprob for s in o.logprobs) / len(o.logprobs))
    assert len(resp.choices) == 1 and resp.choices[0].text == best.text and resp.choices[0].logprobs is None
