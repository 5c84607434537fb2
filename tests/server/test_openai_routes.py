"""The newer OpenAI routes with the official openai client against one real server (SmolLM2):

* /v1/embeddings: vectors of the model's hidden size, normalised, the same batched as one by one, base64
  as float (the pooled hidden states themselves are checked against transformers in
  tests/runtime/test_embeddings.py);
* streamed tool calls: the arguments arrive in pieces while the model writes them, assembled by the SDK;
* /v1/responses: text, a function call, json_schema, streamed events, previous_response_id.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import openai
import pytest

from tests.random_llama import SMOLLM2_135M
from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def server(apis_server):
    return apis_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(api_key=API_KEY, timeout=60)


def test_vectors_have_the_hidden_size_and_unit_length(client):
    out = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the SDK asks for base64 and decodes it
    vector = np.array(out.data[0].embedding)
    assert vector.shape == (SMOLLM2_135M["hidden_size"],)
    assert abs(float(vector @ vector) - 1.0) < 1e-5  # the cosine of a text with itself
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_equals_one_by_one(client, pooling):
    batch = client.embeddings.create(
        model=MODEL, input=TEXTS, encoding_format="float", extra_body={"pooling": pooling}
    )
    assert [d.index for d in batch.data] == [0, 1, 2]
    for text, item in zip(TEXTS, batch.data):
        alone = client.embeddings.create(model=MODEL, input=text, extra_body={"pooling": pooling})
        assert np.abs(np.array(item.embedding) - np.array(alone.data[0].embedding)).max() < 1e-5
    vectors = np.array([d.embedding for d in batch.data])
    assert np.abs(vectors[0] - vectors[1]).max() > 1e-2  # the inputs are not mixed up


def test_token_ids_embed_as_their_text(client, server):
    tokens = post(server, "/tokenize", {"prompt": TEXTS[1], "add_special_tokens": False})["tokens"]
    by_ids = client.embeddings.create(model=MODEL, input=[tokens], encoding_format="float")
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert np.abs(np.array(by_ids.data[0].embedding) - np.array(by_text.data[0].embedding)).max() < 1e-5


def test_dimensions_and_bad_inputs_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert info.value.body["param"] == "dimensions" and "576" in info.value.body["message"]
    assert client.embeddings.create(model=MODEL, input="x", dimensions=576).data  # its own size is fine
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=["ok", ""])
    assert info.value.body["param"] == "input[1]"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(exc.read().decode()) from exc


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_streamed_tool_call_arguments_arrive_while_generated(client):
    pieces, finished_at = [], None
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append((time.monotonic(), event.arguments_delta))
            elif event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].finish_reason:
                finished_at = time.monotonic()
        final = stream.get_final_completion()  # the SDK assembles the streamed tool-call deltas
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "".join(p for _, p in pieces) == call.function.arguments
    assert len(pieces) >= 3, pieces
    assert pieces[0][0] < finished_at  # the first piece came before generation ended


RESPONSE_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER}
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_text_equals_the_chat_completion(client):
    response = client.responses.create(
        model=MODEL,
        input="Name a color.",
        instructions="Answer in one word.",
        max_output_tokens=12,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.id.startswith("resp_") and response.output[0].type == "message"


def test_response_function_call_then_its_output_with_previous_response_id(client):
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}
        ],
        tools=RESPONSE_TOOLS,
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert follow.output_text and follow.previous_response_id == first.id
    # the follow-up saw the whole conversation: more input than the new item alone
    assert follow.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=MODEL, input="hi", previous_response_id="resp_unknown", max_output_tokens=4
        )
    assert info.value.body["param"] == "previous_response_id"


def test_response_json_schema(client):
    response = client.responses.create(
        model=MODEL,
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_response_stream_events_assemble_in_the_sdk(client):
    with client.responses.stream(
        model=MODEL, input="Write a short sentence about the sea.", max_output_tokens=16, temperature=0
    ) as stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    # at max_output_tokens the stream ends with response.incomplete, as OpenAI's does
    assert types[-1] in ("response.completed", "response.incomplete") and types.count(types[-1]) == 1
    final = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3 and "".join(deltas) == final.output_text
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=RESPONSE_TOOLS,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert len(deltas) >= 3 and "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_new_routes_are_counted_by_handler_and_a_404_is_logged_once(server, client):
    client.embeddings.create(model=MODEL, input="count me")
    for _ in range(2):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url + "/v1/no-such-route", timeout=10)
        assert info.value.code == 404
    metrics = server.metrics()
    assert metrics["prescient:http_responses_total{code=200,handler=/v1/embeddings}"] >= 1
    assert metrics["prescient:http_responses_total{code=404,handler=unmatched}"] >= 2
    assert server.output().count("404: no route GET /v1/no-such-route") == 1
