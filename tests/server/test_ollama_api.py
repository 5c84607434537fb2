"""Ollama's API with the official ollama Python client against a real server (SmolLM2): chat streamed and
not (the same greedy text as the OpenAI chat route), generate, format as a JSON schema, list, show, embed,
and Ollama's error shape."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import numpy as np
import ollama
import pytest

from tests.random_llama import SMOLLM2_135M
from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "num_predict": 12}
ASK = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a planet."}]


@pytest.fixture(scope="module")
def server(apis_server):
    return apis_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})


def test_chat_streamed_and_not_equal_the_openai_route(client, server):
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=False)
    pieces = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    reference = server.openai_client(api_key=API_KEY).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, temperature=0
    )
    text = reference.choices[0].message.content
    assert whole.message.content == text and "".join(p.message.content for p in pieces) == text
    assert len(pieces) >= 3 and pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert whole.done_reason == ("length" if reference.choices[0].finish_reason == "length" else "stop")
    assert whole.prompt_eval_count == reference.usage.prompt_tokens
    assert whole.eval_count == reference.usage.completion_tokens


def test_generate_and_format_schema(client, server):
    out = client.generate(model=MODEL, prompt="The sky is", options=GREEDY, stream=False)
    assert out.response and out.done and out.eval_count <= 12
    # without "stream" the server streams NDJSON, as Ollama does (the client always sends the field)
    body = {"model": MODEL, "prompt": "1, 2, 3,", "raw": True, "options": {"num_predict": 5}}
    request = urllib.request.Request(
        server.url + "/api/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.read().splitlines()]
    assert len(lines) >= 3 and lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    assert lines[-1]["eval_count"] == 5 and lines[-1]["done_reason"] == "length"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "moons": {"type": "integer"}},
        "required": ["name", "moons"],
        "additionalProperties": False,
    }
    reply = client.chat(
        model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 40}, stream=False
    )
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_list_show_version_and_embed(client, server):
    models = client.list().models
    assert [m.model for m in models] == [MODEL]
    shown = client.show(MODEL)
    assert shown.modelinfo["llama.embedding_length"] == SMOLLM2_135M["hidden_size"]
    assert "embedding" in shown.capabilities
    vectors = client.embed(model=MODEL, input=["first text", "second text"]).embeddings
    alone = server.openai_client(api_key=API_KEY).embeddings.create(
        model=MODEL, input="second text", encoding_format="float"
    )
    assert len(vectors) == 2 and len(vectors[0]) == SMOLLM2_135M["hidden_size"]
    assert np.abs(np.array(vectors[1]) - np.array(alone.data[0].embedding)).max() < 1e-5


def test_errors_come_in_ollamas_shape(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=ASK, stream=False)
    assert info.value.status_code == 404 and "no-such-model" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=ASK, options={"num_predict": -7}, stream=False)
    assert info.value.status_code == 400 and "num_predict" in info.value.error
