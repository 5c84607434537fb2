"""Load time and memory of the size ladder's files (tests/bench/size_ladder.py): this engine with its matrices laid
from the mapped file straight into the kernels' tiles (runtime.quant.gguf_raw), the same engine through the
parsed blocks (GGUFBlocks, the path before; what it takes where the file path has no layout), and llama.cpp
built for this CPU (load only: llama_model_load_from_file and its context), each in a fresh process,
alternating, `BENCH_LOAD_ROUNDS` rounds (default 3); medians shown.

Ours: Engine.from_pretrained as the sizes bench makes it (a 1 GiB KV pool on fresh anonymous pages); resident
after load and peak while loading over the file, both less the pool's resident pages (mincore).
`BENCH_LOAD_DECODE=1` adds one stream's decode (tokens/s, tests/bench/bench_engine.decode_rate) to both of ours.

    python -m tests.bench load
    BENCH_LOAD_SIZES=1b,3b BENCH_LOAD_TYPES=q4_k_m python -m tests.bench load
"""

from __future__ import annotations

import os
import statistics
import sys

from tests.bench import llama_cpp_native
from tests.bench.bench_sizes import THREADS, _child
from tests.bench.size_ladder import model_file

SIZES = os.environ.get("BENCH_LOAD_SIZES", "1b").split(",")
TYPES = os.environ.get("BENCH_LOAD_TYPES", "q4_0,q8_0,q4_k_m,q5_k_m,q6_k").split(",")
ROUNDS = int(os.environ.get("BENCH_LOAD_ROUNDS", "3"))
DECODE = os.environ.get("BENCH_LOAD_DECODE", "0") == "1"

_OURS = (
    llama_cpp_native.MEMORY_STATUS
    + """
import json, os, sys, time, torch
torch.set_num_threads(THREADS)
import runtime.model.model as model_module
if sys.argv[2] == "parsed":
    model_module.relayable = lambda *a: False  # every matrix through GGUFBlocks, as before the file path
from runtime import Engine
path = sys.argv[1]
rss0 = status("VmRSS")
start = time.perf_counter()
engine = Engine.from_pretrained(
    path, kv_cache_bytes=1 << 30, max_num_seqs=32, max_num_batched_tokens=512, quantization="gguf"
)
load = time.perf_counter() - start
kv = resident(engine.kv.pool.data_ptr(), engine.kv.pool.numel() * engine.kv.pool.element_size())
out = {"load_s": load, "rss": status("VmRSS") - rss0 - kv, "peak": status("VmHWM") - rss0 - kv, "kv_bytes": kv}
if sys.argv[3] == "1":
    from tests.bench.bench_engine import decode_rate
    out["x1"] = decode_rate(engine, 1)[0]
print(json.dumps(out))
"""
).replace("THREADS", str(THREADS))

_LLAMA_CPP = (
    llama_cpp_native.MEMORY_STATUS
    + """
import json, sys, time
import llama_cpp as L
path, threads = sys.argv[1], int(sys.argv[2])
L.llama_backend_init()
rss0 = status("VmRSS")
start = time.perf_counter()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, 8
cp.n_threads = cp.n_threads_batch = threads
ctx = L.llama_init_from_model(model, cp)
load = time.perf_counter() - start
print(json.dumps({"load_s": load, "rss": status("VmRSS") - rss0, "peak": status("VmHWM") - rss0}))
"""
)


def _ours(path, how: str) -> dict:
    script = _OURS.replace("sys.argv[2]", repr(how)).replace("sys.argv[3]", repr("1" if DECODE else "0"))
    return _child(script, path)


def run() -> dict:
    system = llama_cpp_native.ensure(log=lambda m: print(m, file=sys.stderr))
    rows = []
    for size in SIZES:
        for kind in TYPES:
            path = model_file(size, kind, log=lambda m: print(m, file=sys.stderr))
            size_bytes = path.stat().st_size
            runs = {"file": [], "parsed": [], "llama.cpp": []}
            for _ in range(ROUNDS):
                runs["file"].append(_ours(path, "file"))
                runs["parsed"].append(_ours(path, "parsed"))
                runs["llama.cpp"].append(_child(_LLAMA_CPP.replace("sys.argv[2]", str(THREADS)), path))

            def med(how, key, runs=runs):
                return statistics.median(r[key] for r in runs[how])

            cpp = med("llama.cpp", "load_s")
            for how in ("file", "parsed", "llama.cpp"):
                row = {
                    "model": f"{size} {kind}",
                    "path": how,
                    "file MiB": size_bytes / 2**20,
                    "load s": med(how, "load_s"),
                    "load spread": "-".join(f"{f(r['load_s'] for r in runs[how]):.2f}" for f in (min, max)),
                    "load / llama.cpp": med(how, "load_s") / cpp,
                    "rss / file": med(how, "rss") / size_bytes,
                    "peak / file": med(how, "peak") / size_bytes,
                }
                if DECODE and how != "llama.cpp":
                    row["x1"] = med(how, "x1")
                rows.append(row)
    return {
        "title": "Load: time and memory, the file path against the parsed path and llama.cpp built for this CPU",
        "rows": rows,
        "notes": [
            f"CPU: {llama_cpp_native.cpu_description()}",
            f"llama.cpp (llama-cpp-python {llama_cpp_native.VERSION}, native build): {system}",
            f"threads {THREADS}; rounds {ROUNDS}, alternating fresh processes; medians",
            "ours: resident after load and the load's peak, both less the KV pool's resident pages (a 1 GiB pool "
            "on fresh anonymous pages, resident as written); llama.cpp: n_ctx 4096, 8 sequences, maps the file",
        ],
    }
