"""Anthropic's Messages API with the official anthropic SDK against a real server (SmolLM2) keyed with
--api-key (the server tests/server/conftest.py shares), so that both x-api-key (the SDK's) and Bearer are
exercised: text equals the chat route's for the same conversation, a tool call streams as input_json_delta
pieces, errors come in Anthropic's envelope."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest

from tests.server.conftest import API_KEY as KEY
from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def server(apis_server):
    return apis_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def test_text_equals_the_chat_route(client, server):
    message = client.messages.create(
        model=MODEL,
        system="Answer in one word.",
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=12,
        extra_body={"temperature": 0},  # this SDK no longer names it; clients still send it
    )
    chat = server.openai_client(api_key=KEY).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a fruit."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert message.content[0].type == "text" and message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    count = client.messages.count_tokens(
        model=MODEL, system="Answer in one word.", messages=[{"role": "user", "content": "Name a fruit."}]
    )
    assert count.input_tokens == chat.usage.prompt_tokens


def test_stop_sequence_and_stream_of_text(client):
    with client.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 9."}],
        max_tokens=24,
        extra_body={"temperature": 0},  # this SDK no longer names it; clients still send it
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 3 and "".join(pieces) == final.content[0].text
    stop = final.content[0].text.split()[2]  # a word the same greedy reply is bound to write
    cut = client.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 9."}],
        max_tokens=24,
        extra_body={"temperature": 0},  # this SDK no longer names it; clients still send it
        stop_sequences=[stop],
    )
    assert (
        cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and stop not in cut.content[0].text
    )


def test_tool_use_streamed_and_a_tool_result_turn(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(
        model=MODEL,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=60,
        extra_body={"temperature": 0},  # this SDK no longer names it; clients still send it
    ) as stream:
        partial = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    assert len(partial) >= 3 and json.loads("".join(partial)) == use.input
    jsonschema.validate(use.input, WEATHER)
    reply = client.messages.create(
        model=MODEL,
        messages=[
            *ask,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}],
            },
        ],
        tools=TOOLS,
        max_tokens=12,
        extra_body={"temperature": 0},  # this SDK no longer names it; clients still send it
    )
    assert reply.content and reply.usage.input_tokens > final.usage.input_tokens


def test_errors_use_anthropics_envelope_and_bearer_works(client, server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    req = urllib.request.Request(
        server.url + "/v1/messages",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["type"] == "message"
    req.remove_header("Authorization")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 401 and json.loads(info.value.read())["error"]["type"] == "authentication_error"
