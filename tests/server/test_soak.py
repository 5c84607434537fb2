"""A bounded soak on loopback: concurrent streams, a third of the clients vanish at random points, some
readers stall, some requests are hostile. Afterwards nothing is stuck, the KV cache is empty, nothing runs
or waits, and the server's memory has not grown. The server runs the tiny model (SmolLM2's tokenizer and chat
template, random weights): the front end and the engine's bookkeeping are the point, not the model."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import aiohttp

from tests.server.conftest import MODEL, wait_idle

COMP, CHAT, JSON_TYPE = "/v1/completions", "/v1/chat/completions", "application/json"
HOSTILE = [  # (path, body, Content-Type): each gets a 4xx
    (COMP, b'{"prompt": "x", "temperature": NaN}', JSON_TYPE),
    (COMP, b'{"prompt": "x", "top_p": 1e400}', JSON_TYPE),
    (COMP, b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", JSON_TYPE),
    (COMP, b'{"prompt": "\xff\xfe"}', JSON_TYPE),
    (COMP, json.dumps({"prompt": "x", "stop": ["s"] * 1000}).encode(), JSON_TYPE),
    (COMP, b'{"prompt": "x", "max_tokens": -1}', JSON_TYPE),
    # the caps (server/schema/request_fields.py)
    (COMP, json.dumps({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}).encode(), JSON_TYPE),
    (COMP, json.dumps({"prompt": "x", "logit_bias": {"999999": 1}}).encode(), JSON_TYPE),
    (COMP, json.dumps({"prompt": "x", "user": "u" * 100_000}).encode(), JSON_TYPE),
    (COMP, json.dumps({"prompt": [100] * 40_000, "max_tokens": 1}).encode(), JSON_TYPE),
    (
        COMP,
        json.dumps({"prompt": [100] * 4000, "echo": True, "logprobs": 20, "max_tokens": 1}).encode(),
        JSON_TYPE,
    ),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}] * 2049}).encode(), JSON_TYPE),
    (
        CHAT,
        json.dumps(
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2000)],
            }
        ).encode(),
        JSON_TYPE,
    ),
    (COMP, b'{"prompt": "x", "max_tokens": 1}', "text/plain"),
]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def client(session: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> str:
    kind = rng.choices(["normal", "vanish", "stall", "hostile"], weights=[4, 4, 2, 2])[0]
    if kind == "hostile":
        path, data, content_type = rng.choice(HOSTILE)
        async with session.post(url + path, data=data, headers={"Content-Type": content_type}) as resp:
            assert 400 <= resp.status < 500, resp.status
        return kind
    chat = rng.random() < 0.5
    body = {
        "model": MODEL,
        "max_tokens": rng.randrange(4, 40),
        "stream": True,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell story {i}."}]
    else:
        body["prompt"] = f"Story {i}:"
    leave_after = rng.randrange(0, 6) if kind == "vanish" else None
    events = 0
    async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            if leave_after is not None and events > leave_after:
                return kind  # drop the connection mid-stream
            if kind == "stall":
                await asyncio.sleep(rng.uniform(0.02, 0.2))  # a slow reader
            if line.strip() == b"data: [DONE]":
                return kind
    raise AssertionError(f"stream {i} ({kind}) ended without [DONE]")


def test_soak(tiny_shared_server):
    server = tiny_shared_server

    async def round_of(n: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def staggered(i):
                await asyncio.sleep(rng.uniform(0, 1.5))
                return await client(session, server.url, i, rng)

            return await asyncio.wait_for(asyncio.gather(*(staggered(i) for i in range(n))), timeout=240)

    asyncio.run(round_of(12, seed=1))  # warm-up: allocator pools, caches
    wait_idle(server)
    before = rss_bytes(server.proc.pid)
    kinds = []
    for _ in range(4):  # bounded: 96 clients
        kinds += asyncio.run(round_of(24, seed=len(kinds) + 2))
    after_metrics = wait_idle(server, timeout=60)
    after = rss_bytes(server.proc.pid)

    assert {"normal", "vanish", "stall", "hostile"} <= set(kinds)
    assert after_metrics["prescient:num_requests_running{}"] == 0
    assert after_metrics["prescient:num_requests_waiting{}"] == 0
    assert after_metrics["prescient:kv_cache_usage_perc{}"] == 0.0
    assert after - before < 64 << 20, f"RSS grew by {(after - before) >> 20} MiB over {len(kinds)} clients"
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:  # and it still answers
        assert r.status == 200
