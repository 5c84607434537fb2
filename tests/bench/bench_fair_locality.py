"""Locality-aware fair scheduling: dlpm against vtc, fcfs and lpm on the real server; routers by simulation.

    python -m tests.bench fair_locality               # the real server and model, four policies
    python -m tests.bench fair_locality --replicas 4  # N replicas' real schedulers against a cost model

One server: tenants T1..T4 (weights 1/1/1/2 in the key file), each with a 1,024-token prefix of its own
and 64-token random suffixes, 64 output tokens, kept backlogged by 2 x --max-num-seqs closed-loop clients
each; a KV pool of two prefixes plus the running requests' own blocks; and a well-behaved tenant W
sending short prompts at a low Poisson rate. The servers (dlpm at its default quantum, one
request's charge, and at a fixed 4,096, vtc, fcfs, lpm; BENCH_FAIR_POLICIES=dlpm,dlpm:2048,vtc picks
others) stay up and take the same
workload in turn. Judged per policy: total and output tokens/s, the prefix-cache hit rate (the
server's counters), the largest weighted-service gap between two backlogged tenants over any interval
while both waited (service counted from the client as VTC charges it, divided by the weight), W's TTFT.

Replicas: tests/bench/replica_sim.py, with step costs measured on the offline engine in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from contextlib import ExitStack

from tests.bench.load_generator import RequestSpec, random_prompts
from tests.bench.tenants import (
    W_P,
    W_Q,
    backlogged_intervals,
    cumulative,
    intersect,
    poisson_times,
    service_events,
    token_times,
    ttft_stats,
)

PREFIX, SUFFIX, OUTPUT = 1024, 64, 64
WEIGHTS = {"T1": 1.0, "T2": 1.0, "T3": 1.0, "T4": 2.0}
MAX_NUM_SEQS = 4
CLIENTS = 2 * MAX_NUM_SEQS  # per tenant: always some waiting, whatever runs
BLOCK_SIZE = 8
NUM_BLOCKS = 2 * PREFIX // BLOCK_SIZE + MAX_NUM_SEQS * (SUFFIX + OUTPUT) // BLOCK_SIZE + 16
"""Two tenants' prefixes, each running request's own blocks, a little slack."""
ONE_REQUEST = PREFIX + SUFFIX + 2 * OUTPUT
"""One backlogged request's charge in weighted tokens (w_p = 1, w_q = 2): the quantum dlpm's default
follows on this workload (a weight-1 tenant served about one request a round), the bound's Q for it."""
W_PROMPT, W_OUTPUT, W_RATE = 128, 16, 0.1  # the well-behaved tenant
SECONDS, WINDOW_START = 150.0, 30.0
POLICIES = tuple(os.environ.get("BENCH_FAIR_POLICIES", "dlpm,dlpm:4096,vtc,fcfs,lpm").split(","))
"""Servers in turn; `dlpm:Q` runs dlpm at quantum Q, `dlpm` at its default."""
KEYS = {f"sk-{t.lower()}": t for t in [*WEIGHTS, "W", "warm"]}
KEY_OF = {t: k for k, t in KEYS.items()}


def bound(replicas: int = 1, quantum: int = ONE_REQUEST) -> float:
    """DLPM's 2 (Q + U_p + U_q) for a weight-1 tenant (scheduler/dlpm.py): U_q = w_q x what the running
    requests (max_num_seqs per replica) can still generate."""
    u_p = W_P * (PREFIX + SUFFIX)
    u_q = W_Q * replicas * MAX_NUM_SEQS * OUTPUT
    return 2 * (quantum + u_p + u_q)


def _policy(entry: str) -> tuple[str, int | None]:
    """A POLICIES entry's --policy and --dlpm-quantum ("dlpm:Q": Q; otherwise None, the default)."""
    name, _, q = entry.partition(":")
    return name, int(q) if q else None


def _prefixes(seed: int = 5) -> dict[str, list[int]]:
    return {t: random_prompts(1, PREFIX, seed + k)[0] for k, t in enumerate(WEIGHTS)}


# ---- one server -------------------------------------------------------------------------------------


def _server(policy: str, keys_path: str):
    from tests.server.conftest import running_server

    return running_server(
        "--policy",
        _policy(policy)[0],
        "--api-keys",
        keys_path,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--block-size",
        str(BLOCK_SIZE),
        *(("--dlpm-quantum", str(_policy(policy)[1])) if _policy(policy)[1] else ()),
        "--max-waiting",
        "4096",
        dtype="auto",
    )


def _phase(url: str, prefixes: dict[str, list[int]], pid: int, seed: int):
    from tests.bench.tenants import closed_loop, open_loop  # noqa: F401 - the drivers
    from tests.server.conftest import MODEL

    rng = random.Random(seed)

    def maker(tenant):
        return lambda i: RequestSpec(
            prefixes[tenant] + [rng.randrange(100, 49152) for _ in range(SUFFIX)],
            OUTPUT,
            api_key=KEY_OF[tenant],
            tag=tenant,
        )

    w_times = poisson_times(W_RATE, SECONDS - 5, seed=seed + 1)
    w_specs = [
        (t, RequestSpec(p, W_OUTPUT, api_key=KEY_OF["W"], tag="W"))
        for t, p in zip(w_times, random_prompts(len(w_times), W_PROMPT, seed + 2))
    ]

    async def both():
        return await asyncio.gather(
            closed_loop(url, MODEL, [(CLIENTS, maker(t)) for t in WEIGHTS], duration=SECONDS, pid=pid),
            open_loop(url, MODEL, w_specs, duration=SECONDS),
        )

    (results, samples), (w_results, _) = asyncio.run(both())
    return results + w_results, samples


def _weighted_gap(results, names: list[str], window) -> tuple[float, str]:
    """Largest |W_a(t1,t2)/w_a - W_b(t1,t2)/w_b| over pairs and sub-intervals where both had a request
    waiting, inside the window."""
    worst, pair = 0.0, ""
    curves = {}
    for n in names:
        events = service_events(results, n, W_P / WEIGHTS[n], W_Q / WEIGHTS[n])
        curves[n] = cumulative(events)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = intersect(backlogged_intervals(results, a), backlogged_intervals(results, b))
            both = [
                (max(s, window[0]), min(e, window[1])) for s, e in both if e > window[0] and s < window[1]
            ]
            (wa, ta), (wb, tb) = curves[a], curves[b]
            for s, e in both:
                points = [s] + [t for t in ta + tb if s < t < e] + [e]
                diffs = [wa(t) - wb(t) for t in points]
                if max(diffs) - min(diffs) > worst:
                    worst, pair = max(diffs) - min(diffs), f"{a}-{b}"
    return worst, pair


def _metric(m: dict, name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name + "{"))


def _single(rows: list, notes: list, extra: dict) -> dict:
    from tests.server.conftest import wait_idle

    fd, keys_path = tempfile.mkstemp(suffix=".json", prefix="locality-keys-")
    with os.fdopen(fd, "w") as f:
        json.dump({k: {"tenant": t, "weight": WEIGHTS.get(t, 1.0)} for k, t in KEYS.items()}, f)
    prefixes = _prefixes()
    runs = {}
    # The engines share this host with each other and with whatever else runs: spinning OpenMP threads
    # would take the time slices the busy one needs (README, Flags).
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    try:
        with ExitStack() as stack:
            servers = {p: stack.enter_context(_server(p, keys_path)) for p in POLICIES}
            for server in servers.values():  # warm-up: one short request each
                asyncio.run(_warm(server.url))
                wait_idle(server, timeout=120)
            for policy, server in servers.items():
                before = wait_idle(server, timeout=300)
                results, samples = _phase(server.url, prefixes, server.proc.pid, seed=100)
                after = wait_idle(server, timeout=300)
                runs[policy] = (results, samples, before, after)
    finally:
        os.unlink(keys_path)
    window = (WINDOW_START, SECONDS)
    span = window[1] - window[0]
    figures = {}
    for policy in POLICIES:
        results, samples, before, after = runs[policy]
        out = sum(1 for r in results for t in token_times(r) if window[0] <= t < window[1])
        prompt = sum(
            r.prompt_tokens for r in results if r.chunk_times and window[0] <= r.chunk_times[0] < window[1]
        )
        hits = _metric(after, "prescient:prefix_cache_hits_total") - _metric(
            before, "prescient:prefix_cache_hits_total"
        )
        queries = _metric(after, "prescient:prefix_cache_queries_total") - _metric(
            before, "prescient:prefix_cache_queries_total"
        )
        gap, pair = _weighted_gap(results, list(WEIGHTS), window)
        w = ttft_stats(results, "W")
        served = {
            t: sum(w_ for at, w_ in service_events(results, t) if window[0] <= at < window[1])
            for t in WEIGHTS
        }
        figures[policy] = f = {
            "total tok/s": (out + prompt) / span,
            "output tok/s": out / span,
            "prefix hit rate": hits / queries if queries else None,
            "max weighted gap": gap,
            "gap pair": pair,
            "W TTFT p50 ms": w["TTFT p50 ms"],
            "W TTFT p99 ms": w["TTFT p99 ms"],
            "W done": sum(1 for r in results if r.tag == "W" and r.ok),
            "service T1/T2/T3/T4": "/".join(f"{served[t]:.0f}" for t in WEIGHTS),
        }
        rows.append({"scenario": "one server", "policy": policy, **f})
        extra[f"single_{policy}_metrics"] = samples
    v = figures["vtc"]

    def verdict(ok: bool) -> str:
        return "MET" if ok else "MISSED"

    notes.append(
        f"one server: {len(WEIGHTS)} tenants (weights {'/'.join(f'{w:g}' for w in WEIGHTS.values())}), "
        f"{CLIENTS} closed-loop clients each, prompts {PREFIX}-token tenant prefix + {SUFFIX} random, "
        f"{OUTPUT} output tokens (ignore_eos); W: {W_PROMPT}-token prompts, {W_OUTPUT} out, Poisson "
        f"{W_RATE} req/s; --max-num-seqs {MAX_NUM_SEQS}, --num-blocks {NUM_BLOCKS} x {BLOCK_SIZE} tokens "
        f"(two prefixes + the running requests); dlpm at its default quantum (one request's most "
        f"charge, {ONE_REQUEST} here), dlpm:Q at --dlpm-quantum Q; window {window[0]:.0f}-{window[1]:.0f} s "
        f"of {SECONDS:.0f} s per policy, the servers in turn"
    )
    targets = {}
    for policy in (p for p in POLICIES if _policy(p)[0] == "dlpm"):
        quantum = _policy(policy)[1] or ONE_REQUEST
        d, b = figures[policy], bound(quantum=quantum)
        tp = d["total tok/s"] / v["total tok/s"]
        hr = (d["prefix hit rate"] or 0) / (v["prefix hit rate"] or float("nan"))
        t = targets[policy] = {
            "bound": b,
            "throughput_1_5x": tp >= 1.5,
            "hit_rate_2x": hr >= 2,
            "gap_within_bound": d["max weighted gap"] <= b,
            "gap_within_2x_vtc": d["max weighted gap"] <= 2 * v["max weighted gap"],
            "w_ttft_within_10pct": d["W TTFT p50 ms"] <= 1.1 * v["W TTFT p50 ms"],
        }
        notes.append(
            f"targets, {policy} (Q {quantum}) against vtc: throughput {d['total tok/s']:.0f} vs "
            f"{v['total tok/s']:.0f} tok/s = {tp:.2f}x (>= 1.5x {verdict(t['throughput_1_5x'])}); hit rate "
            f"{d['prefix hit rate']:.2f} vs {v['prefix hit rate']:.2f} = {hr:.2f}x (>= 2x "
            f"{verdict(t['hit_rate_2x'])}); largest gap {d['max weighted gap']:.0f} ({d['gap pair']}) vs "
            f"{v['max weighted gap']:.0f} (within the bound 2(Q + U_p + U_q) = {b:.0f} "
            f"{verdict(t['gap_within_bound'])}, within 2x vtc's {verdict(t['gap_within_2x_vtc'])}); W's "
            f"TTFT p50 {d['W TTFT p50 ms']:.0f} vs {v['W TTFT p50 ms']:.0f} ms (<= vtc + 10% "
            f"{verdict(t['w_ttft_within_10pct'])})"
        )
    return {"targets": targets}


async def _warm(url: str) -> None:
    from tests.bench.tenants import open_loop
    from tests.server.conftest import MODEL

    spec = RequestSpec(random_prompts(1, 16, 1)[0], 2, api_key=KEY_OF["warm"], tag="warm")
    await open_loop(url, MODEL, [(0.0, spec)], duration=0.0, wait_tags={"warm"}, deadline=120.0)


# ---- replicas, simulated ----------------------------------------------------------------------------


ENGINE_BENCH_COST = {"step_s": 0.034, "prefill_token_s": 0.002, "decode_seq_s": 0.0031}
"""The engine bench's figures (DESIGN.md, `make bench`, fp32, 2 threads): prefill 500 tok/s; decode 27 tok/s
for one stream and 241 at 32: a step of 34 ms + 3.1 ms per decoding sequence + 2 ms per prompt token."""


def measure_cost_model():
    """Step costs of the offline engine on this machine (SmolLM2, dtype auto), fitted from a prefill of 512
    tokens and 32 decode steps at batch 1 and 4 (each the median of 3). On a busy machine the fit carries
    the other load; ENGINE_BENCH_COST is the quiet-machine default."""
    from runtime import Engine, SamplingParams
    from tests.bench.replica_sim import CostModel

    engine = Engine.from_pretrained(dtype="auto", kv_cache_bytes=256 << 20, max_num_seqs=8)
    engine.generate(random_prompts(1, 64, 3), SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up

    def timed(prompts, max_tokens):
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start

    prefill = statistics.median(timed(random_prompts(1, 512, 10 + k), 1) for k in range(3))
    one = statistics.median(timed(random_prompts(1, 16, 20 + k), 33) for k in range(3))
    four = statistics.median(timed(random_prompts(4, 16, 30 + k), 33) for k in range(3))
    per_step_1 = max(one - prefill * 16 / 512, 1e-4) / 32
    per_step_4 = max(four - prefill * 64 / 512, 1e-4) / 32
    decode_seq = max((per_step_4 - per_step_1) / 3, 1e-5)
    step = max(per_step_1 - decode_seq, 1e-4)
    return CostModel(step_s=step, prefill_token_s=max(prefill - step, 1e-4) / 512, decode_seq_s=decode_seq)


def _replicas(n: int, measure: bool, rows: list, notes: list, extra: dict) -> dict:
    from scheduler import SchedulerConfig
    from tests.bench.replica_sim import CostModel, TenantLoad, max_gap, service_at, simulate

    cost = measure_cost_model() if measure else CostModel(**ENGINE_BENCH_COST)
    source = "measured on the offline engine in this run" if measure else "the engine bench's figures"
    rng = random.Random(7)
    names = [f"T{i + 1}" for i in range(4 * n)]
    weights = [1.0, 1.0, 1.0, 2.0] * n
    tenants = [
        TenantLoad(
            name, w, [rng.randrange(100, 49152) for _ in range(PREFIX)], SUFFIX, OUTPUT, clients=CLIENTS
        )
        for name, w in zip(names, weights)
    ]
    tenants.append(TenantLoad("W", 1.0, [], W_PROMPT, W_OUTPUT, rate=W_RATE * n))
    cfg = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS)
    duration, start = 900.0, 60.0
    b = bound(n)
    results = {}
    routers = [
        ("round-robin", "fcfs"),
        ("prefix affinity", "fcfs"),
        ("round-robin", "vtc"),
        ("d2lpm", "dlpm"),
    ]
    for router, local in routers:
        res = simulate(
            router,
            tenants,
            replicas=n,
            config=cfg,
            cost=cost,
            duration=duration,
            quantum=ONE_REQUEST,
            baseline_policy=local,
            seed=3,
        )
        done = [o for o in res.outcomes if o.first_token is not None]
        out = sum(o.output for o in res.outcomes if o.end is not None and o.end >= start)
        ttft = sorted(o.first_token - o.arrival for o in done if o.arrival >= start)
        w_ttft = sorted(o.first_token - o.arrival for o in done if o.tenant == "W" and o.arrival >= start)
        gap = max_gap(res, names, (start, duration))
        served = {t: service_at(res.service[t], duration) - service_at(res.service[t], start) for t in names}
        mean = statistics.fmean(served.values())
        label = f"{router} + {local}"
        results[label] = f = {
            "output tok/s": out / (duration - start),
            "prefix hit rate": res.prefix_hits / res.prefix_queries,
            "max weighted gap": gap,
            "within bound": gap <= b,
            "weighted service min/max vs mean": f"{min(served.values()) / mean:.2f}/{max(served.values()) / mean:.2f}",
            "TTFT p99 s": ttft[int(0.99 * (len(ttft) - 1))] if ttft else None,
            "W TTFT p50 s": statistics.median(w_ttft) if w_ttft else None,
            "tokens per replica": "/".join(str(t) for t in res.per_replica_tokens),
        }
        rows.append({"scenario": f"{n} replicas (sim)", "router": label, **f})
        extra.setdefault("sim_service", {})[label] = {
            "weighted service per tenant": served,
            "curves (first 4 tenants)": {
                t: res.service[t][:: max(1, len(res.service[t]) // 300)] for t in names[:4]
            },
        }
    d = results["d2lpm + dlpm"]
    best = max(
        v["output tok/s"] for k, v in results.items() if k.startswith(("round-robin + fcfs", "prefix"))
    )
    baselines = ("round-robin + fcfs", "prefix affinity + fcfs")  # the routers, as vLLM runs them
    others_within = [k for k in baselines if results[k]["within bound"]]
    vtc_rr = results["round-robin + vtc"]
    notes += [
        f"{n} replicas simulated ({duration:.0f} s, measured from {start:.0f} s): {4 * n} tenants with weights "
        f"1/1/1/2 repeated, {CLIENTS} closed-loop clients each, W at {W_RATE * n:.2f} req/s; each replica "
        f"--max-num-seqs {MAX_NUM_SEQS}, {NUM_BLOCKS} blocks; cost model ({source}): "
        f"step {cost.step_s * 1e3:.1f} ms + {cost.prefill_token_s * 1e3:.2f} ms per prompt token + "
        f"{cost.decode_seq_s * 1e3:.2f} ms per decoding sequence",
        f"target: d2lpm throughput >= the better of round-robin and prefix affinity: {d['output tok/s']:.1f} vs "
        f"{best:.1f} output tok/s -> {'MET' if d['output tok/s'] >= best else 'MISSED'}",
        f"target: d2lpm the only one within the bound 2(Q + U_p + U_q) = {b:.0f} (U_q over {n} replicas): "
        f"d2lpm {d['max weighted gap']:.0f}; "
        + ", ".join(f"{k} {v['max weighted gap']:.0f}" for k, v in results.items() if k != "d2lpm + dlpm")
        + f" -> {'MET' if d['within bound'] and not others_within else 'MISSED'} against round-robin and "
        f"prefix affinity over fcfs replicas"
        + (f" ({', '.join(others_within)} also within)" if others_within else ""),
        f"round-robin over vtc replicas is fair too ({'within' if vtc_rr['within bound'] else 'outside'} the "
        f"bound) but at {vtc_rr['output tok/s'] / d['output tok/s']:.2f}x d2lpm's throughput (hit rate "
        f"{vtc_rr['prefix hit rate']:.2f}: every replica sees every tenant and VTC interleaves them)",
    ]
    return {"bound_replicas": b, "cost_model": cost.__dict__, "sim": results}


def run(replicas: int = 1, measure_cost: int = 0) -> dict:
    """replicas > 1: the simulation; measure_cost=1 fits its cost model on this machine's engine first."""
    rows, notes, extra = [], [], {}
    replicas = int(replicas)
    if replicas > 1:
        summary = _replicas(replicas, bool(int(measure_cost)), rows, notes, extra)
        title = f"Locality-aware fair scheduling across {replicas} replicas (simulated)"
    else:
        summary = _single(rows, notes, extra)
        title = "Locality-aware fair scheduling: dlpm vs vtc, fcfs, lpm on one server"
    notes.append(
        "this machine is shared with other sessions' tests and builds: the figures are noisy; ratios are "
        "between policies measured in the same run"
    )
    return {"title": title, "rows": rows, "notes": notes, **summary, **extra}
