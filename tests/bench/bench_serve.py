"""Serving benchmark: the real server on loopback under fixed concurrency, Poisson arrivals and shared prefixes.

Baselines measured in the same run: concurrency 1 (one request at a time, the way a
single-stream server serves) and, for the shared-prefix workload, the same
server started with --no-prefix-caching.
"""
from __future__ import annotations

import asyncio

from tests.bench.load_generator import RequestSpec, random_prompts, run_load, summarize
from tests.server.conftest import MODEL, running_server

INPUT_LEN, OUTPUT_LEN = 128, 128
SHARED_PREFIX, SUFFIX, PREFIX_OUTPUT = 1024, 32, 8


def _closed_loop(url: str, concurrency: int, n: int, seed: int) -> dict:
    specs = [RequestSpec(p, OUTPUT_LEN) for p in random_prompts(n, INPUT_LEN, seed)]
    results, wall = asyncio.run(run_load(url, MODEL, specs, concurrency=concurrency))
    return summarize(results, wall)


def _shared_prefix(url: str, seed: int) -> dict:
    prefix = random_prompts(1, SHARED_PREFIX, seed)[0]
    specs = [RequestSpec(p, PREFIX_OUTPUT) for p in random_prompts(9, SUFFIX, seed + 1, prefix=prefix)]
    # the first request fills the cache; the rest are measured, one at a time so TTFT is pure prefill
    asyncio.run(run_load(url, MODEL, specs[:1], concurrency=1))
    results, wall = asyncio.run(run_load(url, MODEL, specs[1:], concurrency=1))
    return summarize(results, wall)


def run() -> dict:
    rows, notes = [], []
    with running_server("--max-num-seqs", "64", dtype="auto", kv_cache="1GiB") as server:
        asyncio.run(run_load(server.url, MODEL, [RequestSpec(p, 8) for p in random_prompts(2, 32, 99)],
                             concurrency=2))   # warm-up
        for concurrency in (1, 8, 32, 64):
            n = 4 if concurrency == 1 else 2 * concurrency
            rows.append({"workload": f"concurrency {concurrency}", "requests": n,
                         **_closed_loop(server.url, concurrency, n, seed=concurrency)})
        base = rows[0]["output tok/s"]
        for row in rows:
            row["x vs concurrency 1"] = row["output tok/s"] / base
        specs = [RequestSpec(p, OUTPUT_LEN) for p in random_prompts(48, INPUT_LEN, 7)]
        rate = 0.8 * rows[2]["req/s"]   # 80% of what concurrency 32 sustained
        results, wall = asyncio.run(run_load(server.url, MODEL, specs, rate=rate, seed=7))
        rows.append({"workload": f"Poisson {rate:.2f} req/s", "requests": len(specs), **summarize(results, wall)})
        cached = _shared_prefix(server.url, seed=11)
    with running_server("--no-prefix-caching", dtype="auto", kv_cache="1GiB") as server:
        uncached = _shared_prefix(server.url, seed=11)
    rows.append({"workload": f"shared {SHARED_PREFIX}-token prefix, cache on", "requests": 8, **cached})
    rows.append({"workload": f"shared {SHARED_PREFIX}-token prefix, cache off", "requests": 8, **uncached})
    ratio = uncached["TTFT p50 ms"] / cached["TTFT p50 ms"]
    notes.append(f"prompts {INPUT_LEN} tokens, outputs {OUTPUT_LEN} tokens (ignore_eos), greedy; "
                 f"model {MODEL}, dtype auto")
    notes.append(f"shared-prefix TTFT p50: {uncached['TTFT p50 ms']:.0f} ms without the prefix cache vs "
                 f"{cached['TTFT p50 ms']:.0f} ms with it: {ratio:.1f}x lower")
    c32 = rows[2]
    notes.append(f"concurrency 32: {c32['output tok/s']:.0f} output tok/s = {c32['x vs concurrency 1']:.1f}x "
                 f"one-at-a-time serving; TTFT p50 {c32['TTFT p50 ms']:.0f} ms")
    return {"title": "Serving: OpenAI API over loopback (vLLM bench-serve metrics)", "rows": rows, "notes": notes,
            "prefix_ttft_ratio": ratio}
