"""A base model (no chat template) behind a real server: completions run, and so does Ollama's /api/generate
(the prompt as it is, as Ollama's default template gives it); every route that renders chat messages
answers 400 in its own API's shape, naming the field the client sent in that API (OpenAI's `messages` /
Responses' `input`, Anthropic's `messages`, Ollama's `messages`, /api/generate's `system`) once, and saying
what to do instead."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.server.conftest import MODEL, tiny_server, write_tiny_smollm2
from tests.server.test_request_caps import post as post_raw

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_server(tmp_path_factory):
    path = write_tiny_smollm2(tmp_path_factory.mktemp("tiny-base"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))  # the template gone: a base model
    assert not (path / "chat_template.jinja").exists()
    with tiny_server(path) as server:
        yield server
    shutil.rmtree(path, ignore_errors=True)


def post(server, route: str, body: dict) -> tuple[int, dict]:
    status, raw = post_raw(server.url, route, body)
    return status, json.loads(raw)


TURN = [{"role": "user", "content": "Hello there"}]
CASES = [
    # route, body, the field as that API names it, where its error's message and field sit
    ("/v1/chat/completions", {"model": MODEL, "messages": TURN, "max_tokens": 4}, "messages", "openai"),
    ("/v1/responses", {"model": MODEL, "input": "Hello there", "max_output_tokens": 4}, "input", "openai"),
    ("/v1/messages", {"model": MODEL, "messages": TURN, "max_tokens": 4}, "messages", "anthropic"),
    ("/api/chat", {"model": MODEL, "messages": TURN, "stream": False}, "messages", "ollama"),
    (
        "/api/generate",
        {"model": MODEL, "prompt": "Hi", "system": "Be brief", "stream": False},
        "system",
        "ollama",
    ),
]


@pytest.mark.parametrize("route, body, field, shape", CASES, ids=[c[0] for c in CASES])
def test_chat_routes_refuse_a_base_model_naming_their_own_field(base_server, route, body, field, shape):
    status, answer = post(base_server, route, body)
    assert status == 400, answer
    if shape == "openai":
        message = answer["error"]["message"]
        assert answer["error"]["param"] == field and answer["error"]["type"] == "invalid_request_error"
    elif shape == "anthropic":
        message = answer["error"]["message"]
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        message = answer["error"]
    assert "no chat template" in message, message
    assert "/v1/completions" in message or "start of the prompt" in message, message
    assert message.startswith(f"{field}: ") and message.count(f"{field}:") == 1, message
    other = {"messages", "input", "prompt", "system"} - {field}
    assert not any(message.startswith(f"{name}:") for name in other), message


def test_completions_still_run_on_a_base_model(base_server):
    status, answer = post(
        base_server, "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer


def test_ollama_generate_gives_a_base_model_the_prompt_as_it_is(base_server):
    """/api/generate without `raw` on a base model: the tokens /v1/completions gives the same prompt (greedy),
    as Ollama's default template ("{{ .Prompt }}") would."""
    prompt = "The capital of France is"
    status, ollama = post(
        base_server,
        "/api/generate",
        {"model": MODEL, "prompt": prompt, "stream": False, "options": {"num_predict": 6, "temperature": 0}},
    )
    assert status == 200 and ollama["eval_count"] == 6 and ollama["done_reason"] == "length", ollama
    status, openai = post(
        base_server,
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0},
    )
    assert status == 200
    assert ollama["response"] == openai["choices"][0]["text"]
    assert ollama["prompt_eval_count"] == openai["usage"]["prompt_tokens"]
