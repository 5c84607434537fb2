"""The official openai client against the real server; text must equal the offline engine's (greedy)."""

from __future__ import annotations

import re
import time

import pytest

from runtime import SamplingParams
from tests.server.conftest import MODEL


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_one_and_unknown_is_404(client):
    import openai

    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert "gpt-4o" in info.value.body["message"] and info.value.body["code"] == "model_not_found"


def test_completion_equals_offline_engine(client, offline_engine):
    prompt = "The three primary colors are"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_with_penalties_equals_offline_engine(client, offline_engine):
    prompt = "Repeat after me: la la la la la la"
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.1},
    )
    params = dict(max_tokens=20, temperature=0)
    expected = offline_engine.generate(
        [prompt],
        SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.1, **params),
    )[0]
    assert resp.choices[0].text == expected.text
    assert expected.text != offline_engine.generate([prompt], SamplingParams(**params))[0].text


def test_chat_completion_equals_offline_engine(client, offline_engine):
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the boiling point of water at sea level?"},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    prompt = offline_engine.tokenizer.apply_chat_template(messages, tokenize=True)
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(expected.token_ids)


def test_chat_without_max_tokens_runs_when_the_kv_cache_is_smaller_than_the_context(
    client, server, offline_engine
):
    # this server's 256 MiB KV cache holds fewer tokens than the model's context: the default max_tokens
    # must be what can run (vLLM users omit it routinely), not a 400
    messages = [{"role": "user", "content": "Say hello in French."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    prompt = offline_engine.tokenizer.apply_chat_template(messages, tokenize=True)
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=512, temperature=0))[0]
    assert expected.finish_reason == "stop"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == "stop"


def test_streaming_chat_with_usage_equals_offline_engine(client, offline_engine):
    messages = [{"role": "user", "content": "Name four planets of the solar system."}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    prompt = offline_engine.tokenizer.apply_chat_template(messages, tokenize=True)
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0))[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_completion_with_stop_string(client, offline_engine):
    prompt = "Count: one, two, three, four, five,"
    free = offline_engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0].text
    stop = free.strip().split()[1][:3]
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert stop not in expected.text


def test_seeded_sampling_is_reproducible_over_http(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_tokenize_detokenize_round_trip(server, offline_engine):
    import json
    import urllib.request

    def post(path, body):
        req = urllib.request.Request(
            server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    text = "Paged attention keeps KV blocks."
    tokens = post("/tokenize", {"prompt": text})
    assert tokens["tokens"] == offline_engine.tokenizer.encode(text) and tokens["count"] == len(
        tokens["tokens"]
    )
    assert post("/detokenize", {"tokens": tokens["tokens"]})["prompt"] == text
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == offline_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True
    )


def test_openapi_describes_every_route(server):
    import json
    import urllib.request

    with urllib.request.urlopen(server.url + "/openapi.json") as r:
        doc = json.loads(r.read())
    assert set(doc["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/show",
        "/api/tags",
        "/api/version",
        "/v1/models",
        "/v1/models/{model}",
        "/health",
        "/metrics",
        "/version",
        "/tokenize",
        "/detokenize",
        "/openapi.json",
    }


def test_logs_a_line_per_request_and_throughput(server, client):
    client.completions.create(
        model=MODEL, prompt="Log me", max_tokens=12, user="log-test", extra_body={"ignore_eos": True}
    )
    time.sleep(1.5)
    log = server.output()
    assert re.search(
        r"POST /v1/completions tenant=log-test prompt=\d+ completion=12 cached=\d+ finish=length "
        r"ttft=[\d.]+s e2e=[\d.]+s",
        log,
    ), log[-2000:]
    assert re.search(r"throughput: [\d.]+ generated tokens/s", log), log[-2000:]
