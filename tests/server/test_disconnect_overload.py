"""Clients that vanish mid-stream free everything; more requests than the queue admits get 429.

The servers run the tiny model (SmolLM2's tokenizer, random weights): the bookkeeping and the queue are the
point, not what it generates."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from tests.server.conftest import MODEL, tiny_server, wait_idle

pytestmark = pytest.mark.slow  # real servers


async def stream_and_vanish(session: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> int:
    """Read a random number of chunks (maybe none), then drop the connection."""
    body = {
        "model": MODEL,
        "prompt": f"Story {i}: once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.8,
        "seed": i,
    }
    keep = rng.randrange(0, 12)
    read = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    read += 1
                if read >= keep:
                    break
    except aiohttp.ClientError:
        pass
    return read


async def vanish_during_wait(url: str) -> None:
    """A non-streaming client that gives up before its answer arrives."""
    timeout = aiohttp.ClientTimeout(total=0.3)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            await session.post(
                url + "/v1/completions", json={"prompt": "Long essay:", "max_tokens": 300, "ignore_eos": True}
            )
        except asyncio.TimeoutError:
            pass


def test_fifty_disconnecting_streams_free_every_block(tiny_shared_server):
    server = tiny_shared_server
    rng = random.Random(1234)

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            reads = await asyncio.gather(
                *(stream_and_vanish(session, server.url, i, rng) for i in range(50)),
                *(vanish_during_wait(server.url) for _ in range(5)),
            )
        return reads

    reads = asyncio.run(main())
    assert sum(1 for r in reads if r) > 10  # many did get tokens before leaving
    after = wait_idle(server, timeout=60)
    assert after["prescient:num_requests_running{}"] == 0
    assert after["prescient:num_requests_waiting{}"] == 0
    assert after["prescient:kv_cache_usage_perc{}"] == 0.0
    assert after["prescient:request_success_total{finished_reason=abort}"] >= 50
    # and the server still answers
    import urllib.request

    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_overload_gets_429_with_retry_after_and_the_rest_complete(tiny_model):
    with tiny_server(tiny_model, "--max-num-seqs", "2", "--max-waiting", "3") as server:

        async def one(session, i):
            async with session.post(
                server.url + "/v1/completions",
                json={"prompt": f"Item {i}:", "max_tokens": 200, "ignore_eos": True},
            ) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        async def main():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                return await asyncio.gather(*(one(session, i) for i in range(30)))

        results = asyncio.run(main())
        ok = [r for r in results if r[0] == 200]
        rejected = [r for r in results if r[0] == 429]
        assert len(ok) + len(rejected) == 30
        assert rejected, "30 at once must overflow 2 running + 3 waiting"
        assert len(ok) >= 5
        assert all(r[1] is not None and int(r[1]) >= 1 for r in rejected)
        assert all(r[2]["error"]["type"] == "rate_limit_error" for r in rejected)
        assert all(r[2]["usage"]["completion_tokens"] == 200 for r in ok)
        counted = server.metrics()  # what an operator's 429 alert reads
        assert counted["prescient:http_responses_total{code=429,handler=/v1/completions}"] == len(rejected)
        assert counted["prescient:http_responses_total{code=200,handler=/v1/completions}"] == len(ok)
        assert counted["prescient:requests_rejected_total{reason=queue_full}"] == len(rejected)
        assert counted["prescient:requests_rejected_total{reason=draining}"] == 0
