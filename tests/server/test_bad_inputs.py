"""A table of bad requests: each gets its status and a message naming the problem; the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import MODEL

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, method, path, raw body or dict, status, words the message must contain)
    ("malformed json", "POST", COMP, b'{"prompt": "x",', 400, "not valid JSON"),
    ("body not an object", "POST", COMP, b'["x"]', 400, "JSON object"),
    ("missing prompt", "POST", COMP, {"model": MODEL}, 400, "'prompt' is required"),
    ("prompt wrong type", "POST", COMP, {"prompt": 5}, 400, "'prompt'"),
    ("empty prompt", "POST", COMP, {"prompt": ""}, 400, "must not be empty"),
    ("a prompt in a batch of the wrong type", "POST", COMP, {"prompt": ["a", 5.5]}, 400, "prompt[1]"),
    ("token id out of vocabulary", "POST", COMP, {"prompt": [1, 99999999]}, 400, "token 1"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "'messages' is required"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "non-empty"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (
        "content wrong type",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
    ),
    (
        "image content part",
        "POST",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
            ]
        },
        400,
        "text only",
    ),
    (
        "max_tokens zero",
        "POST",
        COMP,
        {"prompt": "x", "max_tokens": 0},
        400,
        "'max_tokens' must be at least 1",
    ),
    (
        "max_tokens string",
        "POST",
        COMP,
        {"prompt": "x", "max_tokens": "9"},
        400,
        "'max_tokens' must be an integer",
    ),
    (
        "max_completion_tokens negative",
        "POST",
        CHAT,
        {"messages": MSG, "max_completion_tokens": -2},
        400,
        "max_completion_tokens",
    ),
    (
        "temperature too high",
        "POST",
        COMP,
        {"prompt": "x", "temperature": 3},
        400,
        "'temperature' must be in",
    ),
    ("temperature wrong type", "POST", COMP, {"prompt": "x", "temperature": "hot"}, 400, "'temperature'"),
    ("top_p zero", "POST", COMP, {"prompt": "x", "top_p": 0}, 400, "'top_p' must be in"),
    ("top_k below -1", "POST", COMP, {"prompt": "x", "top_k": -5}, 400, "'top_k'"),
    (
        "presence_penalty above 2",
        "POST",
        COMP,
        {"prompt": "x", "presence_penalty": 2.5},
        400,
        "'presence_penalty'",
    ),
    (
        "repetition_penalty zero",
        "POST",
        COMP,
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "'repetition_penalty'",
    ),
    ("seed float", "POST", COMP, {"prompt": "x", "seed": 1.5}, 400, "'seed' must be an integer"),
    ("stop wrong type", "POST", COMP, {"prompt": "x", "stop": [1, 2]}, 400, "'stop[0]'"),
    ("n above the limit", "POST", COMP, {"prompt": "x", "n": 300}, 400, "'n' must be in [1, 16]"),
    ("stream not boolean", "POST", COMP, {"prompt": "x", "stream": "yes"}, 400, "'stream' must be a boolean"),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        {"messages": MSG, "stream_options": {"include_usage": True}},
        400,
        "only allowed when 'stream' is true",
    ),
    ("unknown model", "POST", COMP, {"prompt": "x", "model": "gpt-17"}, 404, "'gpt-17' does not exist"),
    (
        "beyond context",
        "POST",
        COMP,
        {"prompt": "x", "max_tokens": 9000},
        400,
        "maximum context length is 8192",
    ),
    ("prompt alone beyond context", "POST", COMP, {"prompt": [100] * 8200}, 400, "8192"),
    (
        "top_logprobs above 20",
        "POST",
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 25},
        400,
        "'top_logprobs' must be in [0, 20]",
    ),
    ("priority wrong type", "POST", COMP, {"prompt": "x", "priority": "high"}, 400, "'priority'"),
    ("user wrong type", "POST", COMP, {"prompt": "x", "user": 7}, 400, "'user' must be a string"),
    ("detokenize bad ids", "POST", "/detokenize", {"tokens": [-1]}, 400, "outside"),
    ("tokenize nothing", "POST", "/tokenize", {}, 400, "'prompt'"),
    ("unknown route", "GET", "/v2/everything", None, 404, "No route"),
    ("wrong method", "GET", COMP, None, 405, "not allowed"),
    ("oversized body", "POST", COMP, b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, "too large"),
]


def call(url: str, method: str, path: str, body) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_status_and_clear_message(server, case):
    _, method, path, body, status, words = case
    code, payload, _ = call(server.url, method, path, body)
    assert code == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["code"], error  # OpenAI's codes are strings
    assert words in error["message"], error["message"]
    assert "Traceback" not in error["message"]


def test_server_still_serves_after_the_table(server):
    for case in CASES:
        call(server.url, case[1], case[2], case[3])
    code, payload, _ = call(server.url, "POST", COMP, {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert code == 200 and payload["usage"]["completion_tokens"] >= 1
