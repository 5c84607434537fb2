"""An HTTP load generator for OpenAI-compatible servers, reporting what vLLM's `bench serve` reports.

Requests stream (SSE) so every token's arrival is timed. Two arrival modes:
open-loop Poisson (`rate` requests/s, arrivals never wait for answers) and
closed-loop fixed concurrency (`concurrency` clients, each sending its next
request when the last one ends). Prompts are token-id lists of an exact
length, and `ignore_eos` fixes the output length.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestSpec:
    prompt: list[int] | str
    max_tokens: int
    api_key: str | None = None
    tag: str = ""
    """Free label (e.g. the tenant) for grouping results."""
    temperature: float = 0.0


@dataclass
class Result:
    tag: str
    ok: bool
    status: int = 0
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_prompts(
    n: int,
    input_len: int,
    seed: int,
    vocab: int = 49152,
    first_id: int = 100,
    prefix: list[int] | None = None,
) -> list[list[int]]:
    """n prompts of exactly input_len random token ids, optionally after a shared prefix."""
    rng = random.Random(seed)
    prefix = prefix or []
    return [prefix + [rng.randrange(first_id, vocab) for _ in range(input_len)] for _ in range(n)]


async def stream_completion(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, result: Result, t0: float
) -> None:
    """One streamed completion, filling `result` as it goes (a cancelled request keeps what it received).
    Times are seconds since t0; result.start must already be set."""
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error = (await resp.text())[:200]
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    if not result.chunk_times:
                        result.ttft = now - result.start
                    result.chunk_times.append(now)
        result.e2e = time.perf_counter() - t0 - result.start
        result.ok = result.output_tokens > 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = repr(exc)


async def _one(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, t0: float) -> Result:
    result = Result(tag=spec.tag, ok=False, start=time.perf_counter() - t0)
    await stream_completion(session, url, model, spec, result, t0)
    return result


async def run_load(
    url: str,
    model: str,
    specs: list[RequestSpec],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
) -> tuple[list[Result], float]:
    """Send every spec; returns (results in spec order, wall seconds)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    results: list[Result | None] = [None] * len(specs)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        if rate is not None:
            rng = random.Random(seed)
            tasks = []
            next_at = 0.0
            for spec in specs:
                delay = t0 + next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(session, url, model, spec, t0)))
                next_at += rng.expovariate(rate)
            for i, r in enumerate(await asyncio.gather(*tasks)):
                results[i] = r
        else:
            queue = list(enumerate(specs))
            queue.reverse()

            async def client():
                while queue:
                    i, spec = queue.pop()
                    results[i] = await _one(session, url, model, spec, t0)

            await asyncio.gather(*(client() for _ in range(concurrency or 1)))
        wall = time.perf_counter() - t0
    return results, wall


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[Result], wall: float) -> dict:
    """The figures `vllm bench serve` prints: throughput, and TTFT/TPOT/ITL/E2E medians and p99 (ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    itl = [x * 1e3 for r in ok for x in r.itls]
    e2e = [r.e2e * 1e3 for r in ok]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": wall,
        "req/s": len(ok) / wall,
        "output tok/s": out_tokens / wall,
        "total tok/s": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
        "TTFT p50 ms": percentile(ttft, 50),
        "TTFT p99 ms": percentile(ttft, 99),
        "TPOT p50 ms": percentile(tpot, 50),
        "TPOT p99 ms": percentile(tpot, 99),
        "ITL p50 ms": percentile(itl, 50),
        "ITL p99 ms": percentile(itl, 99),
        "E2E p50 ms": percentile(e2e, 50),
        "E2E p99 ms": percentile(e2e, 99),
        "mean TTFT ms": statistics.fmean(ttft) if ttft else None,
    }
