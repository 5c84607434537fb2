"""Streaming sends deltas; what a client joins from them equals the non-streamed answer, on the real model.

Same prompt, seed and stop strings, once streamed and once not, through the official `openai` client against
a real server: the text, the finish reason, and with logprobs the tokens and their logprobs agree. Requests
run one at a time, so both see the same batch shapes and the same floating-point sums. The server is the
APIs' shared one, with the packed default weights: nothing here is compared with a float32 oracle.
"""

from __future__ import annotations

import pytest

from tests.server.conftest import API_KEY


@pytest.fixture(scope="module")
def server(apis_server):
    return apis_server


@pytest.fixture
def client(apis_server):
    return apis_server.openai_client(api_key=API_KEY, timeout=120)


CASES = [
    ("Once upon a time", 3, None),
    ("The capital of France is", 7, ["."]),
    ("List three colors:", 11, ["\n", " and"]),
    ("Ünïcödé and emoji 🤖 make", 5, ["🤖", "e"]),
]


@pytest.mark.parametrize("prompt,seed,stop", CASES)
def test_streamed_completion_equals_the_non_streamed_one(client, prompt, seed, stop):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0.9, seed=seed)
    kwargs.update(stop=stop, n=2, logprobs=1)
    whole = client.completions.create(**kwargs)
    texts, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None:
                tokens[c.index] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert finish[c.index] == c.finish_reason
        expected = list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
        assert [t for t, _ in tokens[c.index]] == [t for t, _ in expected]
        assert [lp for _, lp in tokens[c.index]] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def test_streamed_chat_and_echo_equal_the_non_streamed_ones(client):
    messages = [{"role": "user", "content": "Name two rivers."}]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20, temperature=0.8, seed=2)
    whole = client.chat.completions.create(**kwargs, stop=[","])
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, stop=[","], stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content

    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="Hello there", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs, echo=True, logprobs=1)
    chunks = list(client.completions.create(**kwargs, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed_tokens = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert streamed_tokens == whole.choices[0].logprobs.tokens
