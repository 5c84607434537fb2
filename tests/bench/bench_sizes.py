"""The size ladder: Llama shapes from 1B up (tests/bench/size_ladder.py: random weights quantized by llama.cpp
into the types people download), this engine against llama.cpp built for this CPU
(tests/bench/llama_cpp_native.py) on the same file and threads, in the same run.

Per file: decode 1, 8 and 32 streams (tokens/s over decode-only steps, 64-token prompts, 48 new tokens),
prefill 512 (one prompt), load time (the file read into the page cache first), resident memory after load
and peak while loading (VmRSS / VmHWM of a fresh process, less its own before the load; no KV cache beyond
what the engine makes), and the bandwidth roofline of one stream (read bandwidth / bytes of the weights a step
reads; the bandwidth measured just before each engine's one-stream decode, in the same process or just before
llama.cpp's, since the host's moves from minute to minute). llama.cpp: decode 1 stream and a batch of 8
sequences (its own timings / wall time of llama_decode), prefill 512, load time.
Each engine runs in a fresh process per file and round, ours and llama.cpp alternating, `BENCH_SIZES_ROUNDS`
rounds (default 2); medians are shown, with the spread of the decode figures.

    python -m tests.bench sizes
    BENCH_SIZES=1b,3b,8b BENCH_SIZES_TYPES=q4_k_m,q4_0 BENCH_SIZES_LEVELS=avx2 python -m tests.bench sizes

Levels: the CPU's best kernel level, and the forced `avx2` level where the best is above it. That level is
set against llama.cpp built for this CPU and, in a row of its own, against llama.cpp built for AVX2 alone
(what a CPU without AVX-512 runs; `BENCH_SIZES_CPP_AVX2=0` leaves that build out).
Prefill is also set against each level's compute ceiling, its cheapest 8-bit products on registers alone
(tests/bench/roofline.py's int8_dot_rate), measured at the start.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from runtime.kernels import library as native_kernels
from tests.bench import llama_cpp_native
from tests.bench.roofline import int8_dot_rate, memory_bandwidth
from tests.bench.size_ladder import model_file

SIZES = os.environ.get("BENCH_SIZES", "1b,3b").split(",")
TYPES = os.environ.get("BENCH_SIZES_TYPES", "q4_0,q8_0,q4_k_m,q5_k_m,q6_k").split(",")
ROUNDS = int(os.environ.get("BENCH_SIZES_ROUNDS", "2"))
THREADS = 2

_OURS = (
    llama_cpp_native.MEMORY_STATUS
    + """
import json, statistics, sys, time, torch
torch.set_num_threads(THREADS)
from runtime import Engine
from tests.bench.bench_engine import decode_rate, prefill_rate
from tests.bench.roofline import memory_bandwidth
path = sys.argv[1]
rss0 = status("VmRSS")
start = time.perf_counter()
engine = Engine.from_pretrained(path, kv_cache_bytes=1 << 30, max_num_seqs=32, max_num_batched_tokens=512)
load = time.perf_counter() - start
pool = engine.kv.pool
kv = resident(pool.data_ptr(), pool.numel() * pool.element_size())  # the pool's pages written so far
out = {"load_s": load, "rss": status("VmRSS") - rss0 - kv, "peak": status("VmHWM") - rss0, "kv_bytes": kv,
       "weight_bytes": engine.model.weight_bytes, "dtype": str(engine.model.dtype).replace("torch.", ""),
       "layer_params": engine.model.layer_parameters}
out["prefill"] = prefill_rate(engine)
out["bw"] = memory_bandwidth()  # the minute of the one-stream decode that follows
for b in (1, 8, 32):
    out[f"x{b}"] = statistics.median(decode_rate(engine, b)[0] for _ in range(3 if b == 1 else 1))
print(json.dumps(out))
"""
).replace("THREADS", str(THREADS))


def _child(script: str, path, env: dict | None = None) -> dict:
    """Runs `script` on `path` in a fresh interpreter; the JSON its last line prints."""
    run = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if run.returncode != 0:
        raise RuntimeError(f"bench child failed on {path}:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def levels() -> list[str]:
    names = [level.name for level in native_kernels.cpu_levels()]
    wanted = os.environ.get("BENCH_SIZES_LEVELS")
    if wanted:
        return [n for n in wanted.split(",") if n in names]
    best = names[-1]
    return [best] + (["avx2"] if best != "avx2" and "avx2" in names else [])


def _read_through(path) -> None:
    """Reads the file once, so that it is in the page cache before the first timed load (engine or llama.cpp)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def _spread(values: list[float]) -> str:
    return f"{min(values):,.1f}-{max(values):,.1f}" if len(values) > 1 else ""


def _engines(entry: dict) -> list[list[dict]]:
    """A file's runs per engine and level: ours, llama.cpp's native build and, where measured, its AVX2 one."""
    return [*entry["ours"].values(), entry["llama_cpp"], entry.get("llama_cpp_avx2", [])]


def run() -> dict:
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    system = llama_cpp_native.ensure(log=log)
    # our forced avx2 level against llama.cpp's AVX2 build too, where the CPU's best level is above it
    cpp_levels = ["native"]
    best = native_kernels.cpu_levels()[-1].name
    if "avx2" in levels() and best != "avx2" and os.environ.get("BENCH_SIZES_CPP_AVX2", "1") != "0":
        cpp_levels.append("avx2")
        system_avx2 = llama_cpp_native.ensure(log=log, level="avx2")
    bandwidth = memory_bandwidth()
    # the prefill's compute ceiling of each level this CPU runs; llama.cpp's native build against the best's
    ceiling = {level.name: int8_dot_rate(THREADS, level.name) for level in native_kernels.cpu_levels()}
    ceiling_of = {"native": ceiling[best], "avx2": ceiling.get("avx2", 0.0)}
    rows, raw = [], []
    for size in SIZES:
        for kind in TYPES:
            path = model_file(size, kind, log=log)
            file_bytes = path.stat().st_size
            _read_through(path)  # every load below from the page cache, the first one's included
            ours = {level: [] for level in levels()}
            cpps = {level: [] for level in cpp_levels}
            for _ in range(ROUNDS):
                for level in ours:
                    ours[level].append(_child(_OURS, path, {"PRESCIENT_ISA": level}))
                for level, cpp in cpps.items():
                    bw = memory_bandwidth()  # the minute of llama.cpp's decode
                    cpp.append({**llama_cpp_native.measure(path, THREADS, level=level), "bw": bw})
            raw.append(
                {
                    "size": size,
                    "type": kind,
                    "file_bytes": file_bytes,
                    "ours": ours,
                    "llama_cpp": cpps["native"],
                    **({"llama_cpp_avx2": cpps["avx2"]} if "avx2" in cpps else {}),
                }
            )

            def med(runs, key):
                return statistics.median(r[key] for r in runs)

            ops = 2 * med(next(iter(ours.values())), "layer_params")  # a prompt token's projections

            against = [(level, "native") for level in ours] + [("avx2", "avx2")] * ("avx2" in cpps)
            for level, base in against:
                runs, cpp = ours[level], cpps[base]
                roofline = med(runs, "bw") / med(runs, "weight_bytes")
                rows.append(
                    {
                        "model": f"{size} {kind}",
                        "level": level,
                        "against": f"llama.cpp {base}",
                        "file MiB": file_bytes / 2**20,
                        "read MiB": med(runs, "weight_bytes") / 2**20,
                        "x1": med(runs, "x1"),
                        "x1 spread": _spread([r["x1"] for r in runs]),
                        "x1 / roofline": med(runs, "x1") / roofline,
                        "x1 / llama.cpp": med(runs, "x1") / med(cpp, "x1"),
                        "x8": med(runs, "x8"),
                        "x8 / llama.cpp x8": med(runs, "x8") / med(cpp, "x8"),
                        "x32": med(runs, "x32"),
                        "prefill 512": med(runs, "prefill"),
                        "prefill / llama.cpp": med(runs, "prefill") / med(cpp, "prefill"),
                        "prefill / ceiling": med(runs, "prefill") * ops / ceiling[level],
                        "2x llama.cpp / ceiling": 2 * med(cpp, "prefill") * ops / ceiling[level],
                        "rss / file": med(runs, "rss") / file_bytes,
                        "peak / file": (med(runs, "peak") - med(runs, "kv_bytes")) / file_bytes,
                        "load s": med(runs, "load_s"),
                        "load / llama.cpp": med(runs, "load_s") / med(cpp, "load_s"),
                    }
                )
            for base, cpp in cpps.items():
                rows.append(
                    {
                        "model": f"{size} {kind}",
                        "level": f"llama.cpp {base}",
                        "file MiB": file_bytes / 2**20,
                        "x1": med(cpp, "x1"),
                        "x1 spread": _spread([r["x1"] for r in cpp]),
                        "x1 / roofline": med(cpp, "x1") / (med(cpp, "bw") / file_bytes),
                        "x8": med(cpp, "x8"),
                        "prefill 512": med(cpp, "prefill"),
                        "prefill / ceiling": med(cpp, "prefill") * ops / ceiling_of[base],
                        "rss / file": med(cpp, "rss") / file_bytes,
                        "load s": med(cpp, "load_s"),
                    }
                )
    return {
        "title": "Sizes: Llama shapes in the downloaded types, against llama.cpp built for this CPU",
        "rows": rows,
        "raw": raw,
        "bandwidth": bandwidth,
        "notes": [
            f"CPU: {llama_cpp_native.cpu_description()}",
            f"llama.cpp (llama-cpp-python {llama_cpp_native.VERSION}, native build): {system}",
            *(
                [f"llama.cpp avx2 (the same, GGML_NATIVE off, AVX2 without AVX-512): {system_avx2}"]
                * (len(cpp_levels) > 1)
            ),
            f"memory read bandwidth at the start: {bandwidth / 1e9:.1f} GB/s, before each decode: "
            f"{_spread([r['bw'] / 1e9 for f in raw for runs in _engines(f) for r in runs])}"
            f" GB/s; threads {THREADS}; rounds {ROUNDS}",
            "roofline of one stream: the bandwidth measured just before that engine's decode (median over the "
            "rounds) / bytes of weights a step reads (ours: the engine's count; llama.cpp: the file's size)",
            "peak / file: the load's peak resident set less the KV pool's resident pages; rss / file: after load, "
            "less those",
            "prefill / ceiling: 2 x the layers' projection parameters a prompt token multiplies by x tokens/s, over "
            "the level's 8-bit products on registers alone (csrc/compute_peak.c; "
            + ", ".join(f"{level} {rate / 1e9:,.0f} GOP/s" for level, rate in reversed(ceiling.items()))
            + f" on {THREADS} threads; llama.cpp's native build against the best level's, its AVX2 build against "
            "avx2's); 2x llama.cpp / ceiling: the share of our level's ceiling the 2x target takes",
        ],
    }
