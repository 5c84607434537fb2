"""After a burst of concurrent streams, /metrics agrees with what the clients were served."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp

from tests.server.conftest import MODEL, wait_idle


async def stream_one(session: aiohttp.ClientSession, url: str, i: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write {i + 2} words about rivers."}],
        "max_tokens": 8 + i % 11,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, pieces = None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                pieces += 1
    return usage


def test_metrics_match_a_burst_of_streams(server):
    before = wait_idle(server)

    async def burst():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(stream_one(session, server.url, i) for i in range(12)))

    usages = asyncio.run(burst())
    after = wait_idle(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    n = len(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert delta("prescient:time_to_first_token_seconds_count{}") == n
    assert delta("prescient:e2e_request_latency_seconds_count{}") == n
    assert delta("prescient:request_queue_time_seconds_count{}") == n
    # one inter-token gap between each pair of consecutive tokens of a request
    assert delta("prescient:inter_token_latency_seconds_count{}") == completion - n
    assert delta("prescient:prompt_tokens_total{}") == prompt
    assert delta("prescient:generation_tokens_total{}") == completion
    assert delta("prescient:request_prompt_tokens_sum{}") == prompt
    assert delta("prescient:request_generation_tokens_sum{}") == completion
    reasons = {k: v for k, v in after.items() if k.startswith("prescient:request_success_total")}
    assert (
        sum(reasons.values())
        - sum(v for k, v in before.items() if k.startswith("prescient:request_success_total"))
        == n
    )
    # histogram buckets are cumulative and end at the count
    assert (
        after["prescient:time_to_first_token_seconds_bucket{le=+Inf}"]
        == after["prescient:time_to_first_token_seconds_count{}"]
    )
    assert after["prescient:kv_cache_usage_perc{}"] == 0
    # the engine core's thread choice reaches the front end: threads within the cores, rows split only over two
    # or more of them
    threads, split = after["prescient:cpu_threads{}"], after["prescient:cpu_split{}"]
    assert 1 <= threads <= len(os.sched_getaffinity(0)) and split in (0, 1) and (not split or threads >= 2)
    served = sum(v for k, v in after.items() if k.startswith("prescient:tenant_service_tokens_total")) - sum(
        v for k, v in before.items() if k.startswith("prescient:tenant_service_tokens_total")
    )
    assert served == prompt + completion


def test_prefix_cache_metrics_count_hits(server, client):
    before = wait_idle(server)
    system = "You are a careful assistant for a bakery. " * 8
    for question in ("What bread is best for toast?", "Do you sell croissants?"):
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
    after = wait_idle(server)
    hits = after["prescient:prefix_cache_hits_total{}"] - before["prescient:prefix_cache_hits_total{}"]
    queries = (
        after["prescient:prefix_cache_queries_total{}"] - before["prescient:prefix_cache_queries_total{}"]
    )
    assert hits >= 64 and queries > hits


def test_ttft_is_recorded_for_streams_abandoned_after_their_first_token(server):
    """A client that gives up after its first token still had a first token: leaving it out of TTFT would
    hide exactly the slow first tokens that make clients give up."""
    before = wait_idle(server)

    async def first_token_then_leave(session, i):
        body = {"model": MODEL, "prompt": f"Tale {i}:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    return  # leaving the block drops the connection

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await asyncio.gather(*(first_token_then_leave(session, i) for i in range(3)))

    asyncio.run(main())
    after = wait_idle(server)
    assert (
        after["prescient:request_success_total{finished_reason=abort}"]
        - before.get("prescient:request_success_total{finished_reason=abort}", 0)
        == 3
    )
    assert (
        after["prescient:time_to_first_token_seconds_count{}"]
        - before["prescient:time_to_first_token_seconds_count{}"]
        == 3
    )
