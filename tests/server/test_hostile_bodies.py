"""Hostile request bodies: each gets a 4xx naming the problem, or a correct answer; never a 5xx.

After the whole table the engine still serves (a request that killed the engine thread would leave every
later request with a 500), and /health is still ok.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tests.server.test_bad_inputs import CHAT, COMP, MSG, call

pytestmark = pytest.mark.slow  # real servers

HUGE_INT = "9" * 4300 + "1"  # beyond Python's int-from-string limit: json.loads itself raises ValueError
BIG_INT = "9" * 4000  # within the limit: a real int, but no float holds it


def raw(template: str) -> bytes:
    return template.encode()


CASES = [
    # (id, path, raw body, status, words the message must contain)
    ("temperature NaN", COMP, raw('{"prompt": "Hello", "max_tokens": 3, "temperature": NaN}'), 400, "NaN"),
    ("top_p NaN", COMP, raw('{"prompt": "Hello", "max_tokens": 3, "top_p": NaN}'), 400, "NaN"),
    ("temperature Infinity", COMP, raw('{"prompt": "Hello", "temperature": Infinity}'), 400, "Infinity"),
    (
        "penalty -Infinity",
        CHAT,
        raw('{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}'),
        400,
        "Infinity",
    ),
    (
        "NaN deep inside",
        CHAT,
        raw('{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": [1, NaN]}}'),
        400,
        "NaN",
    ),
    ("float overflowing to inf", COMP, raw('{"prompt": "Hello", "top_p": 1e400}'), 400, "finite"),
    (
        "4,300-digit max_tokens",
        COMP,
        raw(f'{{"prompt": "Hello", "max_tokens": {HUGE_INT}}}'),
        400,
        "digits",
    ),
    (
        "4,000-digit temperature",
        COMP,
        raw(f'{{"prompt": "Hello", "temperature": {BIG_INT}}}'),
        400,
        "'temperature'",
    ),
    ("4,000-digit seed", COMP, raw(f'{{"prompt": "Hello", "seed": {BIG_INT}}}'), 400, "'seed'"),
    ("seed beyond 64 bits", COMP, raw('{"prompt": "Hello", "seed": 18446744073709551616}'), 400, "64 bits"),
    (
        "4,000-digit presence_penalty",
        COMP,
        raw(f'{{"prompt": "Hello", "presence_penalty": -{BIG_INT}}}'),
        400,
        "'presence_penalty'",
    ),
    (
        "nested 50,000 deep",
        COMP,
        raw('{"prompt": "Hello", "x": ' + "[" * 50_000 + "]" * 50_000 + "}"),
        400,
        "nested",
    ),
    ("nested objects 50,000 deep", CHAT, raw('{"a": ' * 50_000 + "1" + "}" * 50_000), 400, "nested"),
    ("invalid UTF-8", COMP, b'{"prompt": "caf\xe9 \xff"}', 400, "UTF-8"),
    ("wrong type: messages a string", CHAT, raw('{"messages": "hello"}'), 400, "'messages'"),
    (
        "wrong type: temperature a list",
        COMP,
        raw('{"prompt": "x", "temperature": [1]}'),
        400,
        "'temperature'",
    ),
    (
        "wrong type: role an object",
        CHAT,
        raw('{"messages": [{"role": {"x": 1}, "content": "hi"}]}'),
        400,
        "role",
    ),
    (
        "100,000 stop strings",
        COMP,
        json.dumps({"prompt": "x", "stop": ["a"] * 100_000}).encode(),
        400,
        "'stop' may hold at most",
    ),
    (
        "a 100,000-character stop string",
        COMP,
        json.dumps({"prompt": "x", "stop": "z" * 100_000}).encode(),
        400,
        "'stop' strings may be at most",
    ),
    (
        "100,000 stop token ids",
        COMP,
        json.dumps({"prompt": "x", "stop_token_ids": [5] * 100_000}).encode(),
        400,
        "'stop_token_ids'",
    ),
    (
        "priority raised above the caller's own",
        COMP,
        raw('{"prompt": "x", "priority": -1}'),
        400,
        "'priority'",
    ),
    (
        "priority a 4,000-digit integer",
        COMP,
        raw(f'{{"prompt": "x", "priority": {BIG_INT}}}'),
        400,
        "'priority'",
    ),
    (
        "huge role string",
        CHAT,
        raw('{"messages": [{"role": "%s", "content": "hi"}]}' % ("r" * 100_000)),
        400,
        "role",
    ),
]

ACCEPTED = [
    # Bodies that are odd but valid: the answer is a 200, and the engine must survive the step.
    (
        "repetition_penalty 1e-300",
        {"prompt": "Hello", "max_tokens": 3, "repetition_penalty": 1e-300, "temperature": 1.0, "seed": 1},
    ),
    (
        "repetition_penalty 1e-300, greedy",
        {"prompt": "Hello", "max_tokens": 3, "repetition_penalty": 1e-300, "temperature": 0},
    ),
    ("temperature 1e-300", {"prompt": "Hello", "max_tokens": 3, "temperature": 1e-300}),
    ("duplicate keys: the last one wins", raw('{"prompt": "Hello", "max_tokens": 0, "max_tokens": 2}')),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_body_gets_400_naming_it(server, case):
    _, path, body, status, words = case
    code, payload, _ = call(server.url, "POST", path, body)
    assert code == status, payload
    assert words in payload["error"]["message"], payload["error"]["message"]
    assert len(payload["error"]["message"]) < 500


@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_odd_but_valid_body_is_served(server, case):
    code, payload, _ = call(server.url, "POST", COMP, case[1])
    assert code == 200, payload
    assert payload["usage"]["completion_tokens"] >= 1


def test_temperature_too_small_for_float32_is_greedy(server):
    greedy = call(
        server.url,
        "POST",
        COMP,
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    for tiny in (1e-300, 1e-40, 1e-6):
        code, payload, _ = call(
            server.url,
            "POST",
            COMP,
            {"prompt": "The capital of France is", "max_tokens": 8, "temperature": tiny, "ignore_eos": True},
        )
        assert code == 200, payload
        assert payload["choices"][0]["text"] == greedy[1]["choices"][0]["text"]


def test_engine_still_serves_after_every_hostile_body(server):
    for case in CASES:
        call(server.url, "POST", case[1], case[2])
    for case in ACCEPTED:
        call(server.url, "POST", COMP, case[1])
    code, payload, _ = call(server.url, "POST", CHAT, {"messages": MSG, "max_tokens": 3})
    assert code == 200 and payload["usage"]["completion_tokens"] >= 1
    conn = http.client.HTTPConnection(urlsplit(server.url).netloc, timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
