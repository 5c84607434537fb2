"""response_format (json_object, json_schema) and tools / tool_choice through the official openai client,
sync and async, streaming and not, against the real server: every output parses and validates against
its schema with jsonschema (independent of the grammar engine that enforced it). The server is the APIs'
shared one, with the packed default weights: nothing here is compared with a float32 oracle."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from server.tools.tool_calls import ToolRequest, extract_tool_calls
from tests.server.conftest import API_KEY, MODEL


@pytest.fixture(scope="module")
def server(apis_server):
    return apis_server


@pytest.fixture
def client(apis_server):
    return apis_server.openai_client(api_key=API_KEY, timeout=120)


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "primes": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
            "done": {"type": "boolean"},
        },
        "required": ["primes", "done"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Give me an example {name} record as JSON."}]


async def test_json_schemas_async_batched(server):
    client = server.async_openai_client(api_key=API_KEY, timeout=300)
    resps = await asyncio.gather(
        *[
            client.chat.completions.create(
                model=MODEL, messages=ask(name), response_format=schema_format(name), max_tokens=80, seed=7
            )
            for name in SCHEMAS
        ]
    )
    for name, resp in zip(SCHEMAS, resps):
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_schema_streamed_and_json_object(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("person"),
        response_format=schema_format("person"),
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["person"])
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person (name, age, favourite colour) as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0.8,
        seed=2,
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_invalid_schema_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad)
    assert err.value.body["param"] == "response_format.json_schema" and "bogus" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "yaml"})
    assert err.value.body["param"] == "response_format.type"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert err.value.body["param"] == "tool_choice"


def _check_calls(message, names: set[str]) -> None:
    assert message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_and_named(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    )
    assert resp.choices[0].finish_reason == "tool_calls"
    _check_calls(resp.choices[0].message, {"get_weather", "add"})
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()  # the SDK assembles the streamed tool-call deltas
    assert final.choices[0].finish_reason == "tool_calls"
    _check_calls(final.choices[0].message, {"add"})


def test_tool_choice_none_and_auto_without_a_call_return_content(client):
    for choice in ("none", "auto"):
        resp = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=16, temperature=0
        )
        assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason in ("stop", "length")


def test_a_tool_result_turn_is_accepted(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert resp.choices[0].message.content


def test_auto_parses_the_model_tool_call_syntax():
    """What `auto` does with a reply holding calls (SmolLM2-135M rarely writes one unprompted)."""
    tools = ToolRequest(TOOLS, "auto")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    )
    content, calls = extract_tool_calls(text, tools)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert len({c["id"] for c in calls}) == 2
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert extract_tool_calls(unknown, tools) == (unknown, [])
