"""Multi-tenant load over HTTP for the fairness benchmark, and the service accounting it is judged by.

Each tenant is an API key; requests stream (SSE) so every token's arrival is
timed. Two drivers: open-loop Poisson arrivals per tenant (`open_loop`) and a
closed loop of clients per tenant (`closed_loop`), both run for a fixed window
and then cancel what is left (the client disconnects and the server aborts
it), so a phase ends on time however deep the backlog. A `Result` is filled
in place, so a cancelled request keeps what it had received. /metrics is
sampled once a second meanwhile, with the server process's CPU time.

Service is counted the way VTC charges it, from the client's side: w_p per
prompt token when the request is admitted (taken as its first token's
arrival) and w_q per generated token when that token arrives.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import random
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.bench.load_generator import RequestSpec, Result, percentile, stream_completion

W_P, W_Q = 1.0, 2.0  # the server's VTC weights (scheduler.config defaults)


def poisson_times(rate: float, duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _stream(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, r: Result, t0: float
) -> None:
    """One streamed completion; fills r as it goes and records when it ended (times relative to t0)."""
    try:
        await stream_completion(session, url, model, spec, r, t0)
    finally:
        r.end = time.perf_counter() - t0


def _new_result(spec: RequestSpec, start: float) -> Result:
    r = Result(tag=spec.tag, ok=False, start=start)
    r.prompt_tokens = len(spec.prompt) if isinstance(spec.prompt, list) else 0
    r.end = None
    return r


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), to tell a policy's cost from the machine's load."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


async def _sample_metrics(
    session: aiohttp.ClientSession, url: str, t0: float, every: float, out: list, pid: int | None = None
) -> None:
    keep = (
        "prescient:tenant_service_tokens_total",
        "prescient:tenant_requests_waiting",
        "prescient:tenant_virtual_counter",
        "prescient:num_requests_running",
        "prescient:num_requests_waiting",
    )
    while True:
        try:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            sample = {"t": round(time.perf_counter() - t0, 2)}
            if pid is not None:
                sample["server_cpu_s"] = process_cpu_seconds(pid)
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name in keep:
                        tenant = s.labels.get("tenant")
                        sample[s.name.split(":")[1] + (f"[{tenant}]" if tenant else "")] = s.value
            out.append(sample)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(every)


async def _finish(
    tasks: list[tuple[asyncio.Task, Result]], deadline: float, wait_tags: set[str], t0: float
) -> None:
    """Wait until every request tagged in wait_tags is done (or the deadline passes), then cancel the rest."""
    waited = [task for task, r in tasks if r.tag in wait_tags and not task.done()]
    if waited:
        await asyncio.wait(waited, timeout=max(0.0, t0 + deadline - time.perf_counter()))
    for task, r in tasks:
        if not task.done():
            task.cancel()
            r.error = r.error or "cancelled"
    await asyncio.gather(*(task for task, _ in tasks), return_exceptions=True)
    for _, r in tasks:
        if r.end is None:
            r.end = time.perf_counter() - t0


async def open_loop(
    url: str,
    model: str,
    arrivals: list[tuple[float, RequestSpec]],
    *,
    duration: float,
    wait_tags: set[str] = frozenset(),
    deadline: float | None = None,
    sample_every: float = 1.0,
    pid: int | None = None,
) -> tuple[list[Result], list[dict]]:
    """Send each spec at its time (seconds from now); at `duration`, wait for the requests of wait_tags
    (until `deadline`), then cancel every request still open. Returns (results, /metrics samples)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    samples: list[dict] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        sampler = asyncio.create_task(_sample_metrics(session, url, t0, sample_every, samples, pid))
        tasks = []
        for at, spec in sorted(arrivals, key=lambda a: a[0]):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            r = _new_result(spec, time.perf_counter() - t0)
            tasks.append((asyncio.create_task(_stream(session, url, model, spec, r, t0)), r))
        await asyncio.sleep(max(0.0, t0 + duration - time.perf_counter()))
        await _finish(tasks, deadline if deadline is not None else duration, set(wait_tags), t0)
        sampler.cancel()
    return [r for _, r in tasks], samples


async def closed_loop(
    url: str,
    model: str,
    clients: list[tuple[int, callable]],
    *,
    duration: float,
    sample_every: float = 1.0,
    pid: int | None = None,
) -> tuple[list[Result], list[dict]]:
    """clients: (concurrency, make_spec(i) -> RequestSpec) per tenant; each client sends its next request
    when the last one ends, until `duration`, when every open request is cancelled."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    samples: list[dict] = []
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        sampler = asyncio.create_task(_sample_metrics(session, url, t0, sample_every, samples, pid))
        counters = [0] * len(clients)

        async def client(k: int, make_spec) -> None:
            while time.perf_counter() - t0 < duration:
                spec = make_spec(counters[k])
                counters[k] += 1
                r = _new_result(spec, time.perf_counter() - t0)
                results.append(r)
                try:
                    await _stream(session, url, model, spec, r, t0)
                except asyncio.CancelledError:
                    r.error = r.error or "cancelled"
                    raise

        tasks = [
            asyncio.create_task(client(k, make)) for k, (n, make) in enumerate(clients) for _ in range(n)
        ]
        await asyncio.wait(tasks, timeout=duration)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sampler.cancel()
        for r in results:
            if r.end is None:
                r.end = time.perf_counter() - t0
    return results, samples


# ---- service accounting ---------------------------------------------------------------------------


def token_times(r: Result) -> list[float]:
    """When each generated token arrived. A chunk can hold more than one token (a held-back UTF-8
    character): for a finished request the tokens are spread evenly over its chunks' span."""
    c = r.chunk_times
    if not c:
        return []
    n = r.output_tokens if r.ok else len(c)
    if n == len(c) or n <= 1:
        return list(c[:n])
    return [c[0] + (c[-1] - c[0]) * i / (n - 1) for i in range(n)]


def service_events(
    results: list[Result], tag: str, w_p: float = W_P, w_q: float = W_Q
) -> list[tuple[float, float]]:
    """(time, weighted tokens) for one tenant: the prompt at admission (first token), w_q per token."""
    events = []
    for r in results:
        if r.tag != tag or not r.chunk_times:
            continue
        events.append((r.chunk_times[0], w_p * r.prompt_tokens))
        events += [(t, w_q) for t in token_times(r)]
    events.sort()
    return events


def service_between(events: list[tuple[float, float]], t1: float, t2: float) -> float:
    return sum(w for t, w in events if t1 <= t < t2)


def cumulative(events: list[tuple[float, float]]):
    """A step function W(t): weighted service received before t."""
    times = [t for t, _ in events]
    totals, acc = [], 0.0
    for _, w in events:
        acc += w
        totals.append(acc)

    def at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        return totals[i - 1] if i else 0.0

    return at, times


def backlogged_intervals(results: list[Result], tag: str) -> list[tuple[float, float]]:
    """Union of [arrival, admission) over the tenant's requests: when it had a request waiting.
    Admission is taken as the first token's arrival (a request never admitted waits until it ended)."""
    spans = sorted((r.start, r.chunk_times[0] if r.chunk_times else r.end) for r in results if r.tag == tag)
    merged: list[list[float]] = []
    for s, e in spans:
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def max_service_gap(
    results: list[Result], tag_a: str, tag_b: str, intervals: list[tuple[float, float]]
) -> float:
    """max |W_a(t1,t2) - W_b(t1,t2)| over sub-intervals [t1,t2] of the given intervals (VTC's 2U bound)."""
    wa, ta = cumulative(service_events(results, tag_a))
    wb, tb = cumulative(service_events(results, tag_b))
    worst = 0.0
    for s, e in intervals:
        points = [s] + [t for t in ta + tb if s < t < e] + [e]
        diffs = [wa(t) - wb(t) for t in points]
        worst = max(worst, max(diffs) - min(diffs))
    return worst


def ttft_stats(results: list[Result], tag: str) -> dict:
    """TTFT p50/p99 (ms) of a tenant's requests; a request that never got a token counts with the time
    it had waited when it ended (a lower bound), and is counted as censored."""
    rs = [r for r in results if r.tag == tag and r.status in (0, 200)]
    ttft = [(r.ttft if r.chunk_times else r.end - r.start) * 1e3 for r in rs]
    return {
        "TTFT p50 ms": percentile(ttft, 50),
        "TTFT p99 ms": percentile(ttft, 99),
        "censored": sum(1 for r in rs if not r.chunk_times),
    }
