"""The caps a hostile client meets, each with a 400 naming the field (and /openapi.json saying so); what
it cannot make the server do: bloat it with a long `user`, amplify a small request into a huge echo,
forge log lines, answer a web page's simple request, read a keyed tenant's cache, or send invalid JSON.

The servers run the tiny model (SmolLM2's tokenizer, random weights): the caps are the HTTP layer's, and the
prompts at the caps are thousands of tokens."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from server.auth import api_keys
from tests.server.conftest import MODEL, tiny_server, wait_idle

pytestmark = pytest.mark.slow  # starts servers

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def caps_server(tiny_shared_server):
    return tiny_shared_server


@pytest.fixture(scope="module")
def client(caps_server):
    return caps_server.openai_client(timeout=120)


def post(url: str, path: str, body: bytes | dict, content_type: str | None = "application/json", key=None):
    """(status, raw reply bytes)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=data, headers=headers)
    if content_type is None:  # urllib adds application/x-www-form-urlencoded by itself
        req.remove_header("Content-type")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def strict_json(raw: bytes):
    """JSON as RFC 8259 has it: NaN and Infinity are not numbers."""

    def refuse(name):
        raise AssertionError(f"{name} in a reply body")

    return json.loads(raw, parse_constant=refuse)


def refused(exc_info, param: str, words: str) -> None:
    error = exc_info.value.body
    assert exc_info.value.status_code == 400, error
    assert error["param"] == param, error
    assert words in error["message"], error["message"]


def tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(n)]


@pytest.mark.parametrize(
    "field, body, words",
    [
        ("tools", {"tools": tools(129)}, "at most 128"),
        ("messages", {"messages": MSG * 2049}, "at most 2048"),
        ("logit_bias", {"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
        ("logit_bias", {"logit_bias": {"49152": 5, "3": 1}}, "outside this model's vocabulary"),
        ("user", {"user": "u" * 257}, "at most 256 characters"),
    ],
    ids=["129 tools", "2049 messages", "301 logit_bias entries", "logit_bias id past the vocabulary", "user"],
)
def test_chat_cap(client, field, body, words):
    request = {"model": "x", "messages": MSG, "max_tokens": 1, **body}
    request.pop("model")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, **request)
    refused(info, field, words)


def test_caps_at_the_limit_are_served(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=1,
        tools=tools(128),
        logit_bias={str(i): 1 for i in range(300)},
        user="u" * 256,
    )
    assert reply.usage.completion_tokens == 1


def test_schema_over_the_size_cap(client):
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(6000)}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
        )
    refused(info, "response_format.json_schema.schema", "131,072")


def test_echo_logprobs_are_bounded(client):
    prompt = "the cat sat on the mat " * 600  # about 3,600 tokens; x 21 entries is over the cap
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=20, max_tokens=1)
    refused(info, "logprobs", "65,536")
    small = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1)
    assert len(small.choices[0].logprobs.tokens) == small.usage.prompt_tokens + 1


def test_tiny_temperature_processed_logprobs_are_valid_json(caps_server):
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 4,
        "temperature": 1e-40,
        "logprobs": 3,
        "logprobs_mode": "processed",
    }
    status, raw = post(caps_server.url, "/v1/completions", body)
    assert status == 200, raw
    logprobs = strict_json(raw)["choices"][0]["logprobs"]
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"])


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_read(caps_server, content_type):
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    status, raw = post(caps_server.url, "/v1/completions", body, content_type)
    assert status == 415, raw
    assert strict_json(raw)["error"]["code"] == "unsupported_media_type"
    status, raw = post(caps_server.url, "/tokenize", json.dumps({"prompt": "hi"}).encode(), content_type)
    assert status == 415, raw
    assert post(caps_server.url, "/v1/completions", body, "application/json; charset=utf-8")[0] == 200


def test_client_text_is_escaped_in_the_log(caps_server):
    forged = "mallory\n2026-01-01 00:00:00,000 INFO prescient.server: forged line\x1b[2J"
    body = {"prompt": "Hello", "max_tokens": 1, "user": forged, forged: 1}
    status, raw = post(caps_server.url, "/v1/completions", body)
    assert status == 200, raw
    log = caps_server.output()
    assert "\nforged" not in log.replace("mallory\\n", "") and "forged line\x1b" not in log
    assert "\n2026-01-01 00:00:00,000 INFO prescient.server: forged line" not in log
    assert "mallory\\n2026-01-01" in log  # it is there, escaped


def test_openapi_documents_the_caps(caps_server):
    with urllib.request.urlopen(caps_server.url + "/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    fields = chat["properties"]
    assert fields["tools"]["maxItems"] == 128
    assert fields["messages"]["maxItems"] == 2048
    assert fields["logit_bias"]["maxProperties"] == 300
    assert fields["user"]["maxLength"] == 256
    assert "131,072" in json.dumps(fields["response_format"])
    completion = doc["paths"]["/v1/completions"]["post"]
    assert "65,536" in json.dumps(completion["requestBody"])
    assert "415" in completion["responses"]


# ---- plain keys beside a key file ----------------------------------------------------------------------

SECRET = "Board memo, do not share: the merger closes on the 14th at forty-two a share. " * 6


def test_plain_key_users_are_not_keyed_tenants(tmp_path, tiny_model):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-alice": {"tenant": "alice"}}))
    with tiny_server(tiny_model, "--api-keys", str(keys), "--api-key", "sk-plain") as server:

        def cached(key: str, user: str | None = None) -> int:
            body = {"prompt": SECRET, "max_tokens": 1, **({"user": user} if user else {})}
            status, raw = post(server.url, "/v1/completions", body, key=key)
            assert status == 200, raw
            return (json.loads(raw)["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

        service = "prescient:tenant_service_tokens_total{tenant=%s}"
        assert cached("sk-alice") == 0
        assert cached("sk-alice") > 0  # alice's own prefix hits
        billed = wait_idle(server)[service % "alice"]
        assert cached("sk-plain", user="alice") == 0  # a plain-key caller naming itself alice does not
        metrics = wait_idle(server)
        assert metrics[service % "alice"] == billed  # nor is it billed to her
        assert metrics[service % "user:alice"] > 0


def test_key_file_tenants_cannot_take_the_user_namespace(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-x": {"tenant": "user:alice"}}))
    with pytest.raises(ValueError, match="user:"):
        api_keys(keys, ["sk-plain"])
