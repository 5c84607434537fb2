"""/openapi.json against the real server: every field it documents is accepted with a value built from its
own schema, a value of the wrong type gets a 400 whose `param` names that field, and a field it does not
document is ignored (and logged), as its description says. The server runs the tiny model (SmolLM2's
tokenizer, random weights): the fields are the point, and there are a few hundred requests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import MODEL, TINY_SHAPE
from tests.server.test_bad_inputs import call

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hi"}]
BASE = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 2},
    "/v1/embeddings": {"input": "Hi"},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": MSG, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": MSG},
    "/api/chat": {"messages": MSG, "options": {"num_predict": 2}, "stream": False},
    "/api/generate": {"prompt": "Hi", "options": {"num_predict": 2}, "stream": False},
    "/api/embed": {"input": "Hi"},
    "/api/show": {"model": MODEL},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1]},
}
NEEDS = {
    "model": {"model": MODEL},  # a string from the schema would name a model this server does not serve
    "name": {"name": MODEL},
    "top_logprobs": {"logprobs": True},
    "stream_options": {"stream": True},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "dimensions": {"dimensions": TINY_SHAPE["hidden_size"]},  # the model's hidden size: no other is served
}
"""Fields that need another field beside them (each field's description says so)."""
ROUTE_NEEDS = {
    "/v1/responses": {"tool_choice": {"tools": [{"type": "function", "name": "f"}]}},
    "/v1/messages": {"tool_choice": {"tools": [{"name": "f"}]}},
    "/v1/messages/count_tokens": {"tool_choice": {"tools": [{"name": "f"}]}},
    "/api/generate": {"suffix": {}, "raw": {"prompt": "Hi"}},
}
NEEDS_STATE = {("/v1/responses", "previous_response_id")}
"""Fields whose valid values come from an earlier request (tests/server/test_openai_routes.py has them)."""


def needs(path: str, name: str) -> dict:
    return {**NEEDS.get(name, {}), **ROUTE_NEEDS.get(path, {}).get(name, {})}


def error_param(path: str, payload: dict) -> tuple[str, str]:
    """(the field an error names, its message) in each API's envelope: OpenAI's names it in `param`,
    Anthropic's and Ollama's only in the message, quoted."""
    if path.startswith("/api/"):
        message = payload["error"]
    elif path.startswith("/v1/messages"):
        message = payload["error"]["message"]
    else:
        return payload["error"]["param"], payload["error"]["message"]
    return message.split("'")[1], message


def example(schema: dict):
    """A valid value built from a schema alone, away from the default where the schema allows."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][-1]
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return example(next(b for b in schema[key] if b.get("type") != "null"))
    kind = schema.get("type")
    kind = next(k for k in kind if k != "null") if isinstance(kind, list) else kind
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        high = schema.get("maximum", low + 2)
        return min(low + 1, high) if kind == "integer" else (low + high) / 2
    if kind == "string":
        return "" if schema.get("maxLength") == 0 else "1"
    if kind == "boolean":
        return True
    if kind == "array":
        count = min(max(schema.get("minItems", 1), 1), schema.get("maxItems", 1))
        return [example(schema.get("items", {"type": "integer"}))] * count
    if kind == "object":
        out = {name: example(s) for name, s in schema.get("properties", {}).items()}
        if isinstance(schema.get("additionalProperties"), dict):
            out["1"] = example(schema["additionalProperties"])
        return out
    raise AssertionError(f"no example for {schema}")


def wrong(schema: dict):
    """A value of a JSON type the schema does not take."""
    kinds = set()
    for branch in schema.get("oneOf", schema.get("anyOf", [schema])):
        kind = branch.get("type")
        kinds.update([kind] if isinstance(kind, str) else kind or [])
    for candidate, kind in ((True, "boolean"), ({"a": 1}, "object"), (1.5, "number"), ("x", "string")):
        if kind not in kinds:
            return candidate
    raise AssertionError(f"every JSON type fits {schema}")


@pytest.fixture(scope="module")
def server(tiny_shared_server):
    return tiny_shared_server


@pytest.fixture(scope="module")
def bodies(server) -> dict[str, dict]:
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    out = {}
    for path, item in doc["paths"].items():
        if "post" in item:
            out[path] = item["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(out) == set(BASE), "a POST route without a base body here"
    return out


def test_every_documented_field_is_accepted(server, bodies):
    tried = 0
    for path, schema in bodies.items():
        for name, field in schema["properties"].items():
            if (path, name) in NEEDS_STATE:
                continue
            body = {**BASE[path], name: example(field), **needs(path, name)}
            status, payload, _ = _call(server.url, path, body)
            assert status == 200, (path, name, body, payload)
            tried += 1
    assert tried >= 50


def test_a_wrong_type_is_a_400_naming_the_field(server, bodies):
    for path, schema in bodies.items():
        for name, field in schema["properties"].items():
            body = {**BASE[path], **needs(path, name), name: wrong(field)}
            status, payload, _ = _call(server.url, path, body)
            assert status == 400, (path, name, body, payload)
            param, message = error_param(path, payload)
            assert param.split(".")[0].split("[")[0] == name, (path, name, payload)
            assert f"'{param}'" in message, payload


def test_an_undocumented_field_is_ignored_and_logged(server, bodies):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "frobnicate" not in bodies[path]["properties"]
        assert bodies[path]["additionalProperties"] is True and "ignored" in bodies[path]["description"]
        plain = {**BASE[path], "max_tokens": 5, "temperature": 0}
        status, without, _ = _call(server.url, path, plain)
        status_x, with_x, _ = _call(server.url, path, {**plain, "frobnicate": {"x": 1}, "store": True})
        assert status == status_x == 200, with_x
        text = lambda p: p["choices"][0].get("text", p["choices"][0].get("message", {}).get("content"))  # noqa: E731
        assert text(with_x) == text(without)
    assert "ignored fields not supported by this server: frobnicate, store" in server.output()


def _call(url: str, path: str, body: dict):
    """Like call(), but a streamed answer (stream: true) is read as SSE and must end with [DONE]."""
    if not body.get("stream"):
        return call(url, "POST", path, body)
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    # each API ends its stream its own way: [DONE], its last named event, or a line with done: true
    last = {
        "/v1/responses": "event: response.",
        "/v1/messages": "event: message_stop",
        "/api/chat": '"done":true',
        "/api/generate": '"done":true',
    }.get(path, "data: [DONE]")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            assert last in text.rstrip().splitlines()[-2 if "event:" in last else -1], text[-300:]
            return r.status, {}, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)
