"""Offline engine throughput against the roofline and transformers, measured in the same run.

prefill: one 512-token prompt, tokens/s of the prompt.
decode: N concurrent sequences generating together; total generated tokens/s over steps that only decode.
Ceilings: decode = min(N x memory bandwidth / weight bytes, matmul FLOP/s / (2 x parameters)): a
step reads every weight once and spends 2 FLOP per parameter per sequence;
prefill = matmul FLOP/s / (2 x parameters per token). The matmul FLOP/s is measured once per dtype at the start
of the run (the fastest of several rounds, tests/bench/roofline.py) and used for every row of that dtype, so
configurations of one dtype are ratios against the same ceiling.
Configurations: float32 dequantized, bfloat16 dequantized, bfloat16 on the GGUF's own packed blocks
(the default on a CPU where bfloat16 measures fastest), and float32 on the packed blocks (the default where
float32 does, as on AVX2-only CPUs: the C kernel quantizes the activations to 8 bits per block). The notes
name the vector loops the packed matmul runs with (the instruction-set level of the kernels' build).
llama.cpp built for this CPU (tests/bench/llama_cpp_native.py, built once into a cache) runs the same GGUF
with the same threads in a fresh process, before and after the engine's configurations (medians over both,
so load that drifts during the run hits both sides); its column is skipped where it cannot be built.
Sampling cost: decode x32 at temperature 0.8 / top-p 0.9 against greedy, same engine, same run.
Quality: perplexity on a fixed text (tests/bench/perplexity.py) per configuration, and llama.cpp's on the
same token ids and GGUF from xllamacpp's server (the `bench` extra; one forced token a completion: its
server returns no prompt logprobs).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time

import torch

from runtime import Engine, SamplingParams
from runtime.kernels import library as native_kernels
from runtime.model.checkpoint import default_model_path
from tests.bench import llama_cpp_native
from tests.bench.perplexity import FIXED_TEXT, llama_cpp_perplexity, perplexity
from tests.bench.roofline import matmul_flops, memory_bandwidth

CONFIGS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "gguf"), ("float32", "gguf")]
if os.environ.get("BENCH_ENGINE_CONFIGS"):  # e.g. "float32+gguf,bfloat16+gguf": a subset, in that order
    CONFIGS = [
        (label.partition("+")[0], label.partition("+")[2] or "none")
        for label in os.environ["BENCH_ENGINE_CONFIGS"].split(",")
    ]
BATCHES = [1, 8, 32, 64]
DECODE_TOKENS = 48


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, engine.model.config.vocab_size) for _ in range(n)]


def prefill_rate(engine: Engine) -> float:
    rates = []
    for seed in range(3):
        prompt = _prompt(engine, 512, seed)
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        rates.append(512 / (time.perf_counter() - start))
    return statistics.median(rates)


def decode_rate(engine: Engine, batch: int, **sampling) -> tuple[float, float]:
    """(tokens/s over decode-only steps, fraction of allocated KV slots holding live tokens)."""
    sampling = sampling or {"temperature": 0}
    for i in range(batch):
        engine.add_request(
            None,
            _prompt(engine, 64, 100 + i),
            SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, **sampling),
        )
    tokens = 0
    seconds = 0.0
    fill = []
    while engine.has_unfinished_requests():
        plan_is_decode = engine.stats()["num_waiting"] == 0
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if plan_is_decode and len(outs) == batch:
            tokens += len(outs)
            seconds += elapsed
            stats = engine.stats()
            if stats.get("allocated_token_slots"):
                fill.append(stats["live_token_slots"] / stats["allocated_token_slots"])
    return tokens / seconds, (statistics.median(fill) if fill else float("nan"))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def transformers_rates(dtype: str) -> dict:
    """transformers on the same GGUF: prefill tokens/s (one forward over 512 tokens) and decode tokens/s."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
    ).eval()
    rates = {}
    prompt = torch.randint(100, 49152, (1, 512))
    with torch.no_grad():
        model(prompt)
        seconds = statistics.median(_timed(lambda: model(prompt)) for _ in range(3))
    rates["prefill"] = 512 / seconds
    for batch in (1, 8, 32):
        ids = torch.randint(100, 49152, (batch, 64))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            two = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=34, min_new_tokens=34, do_sample=False)
            full = time.perf_counter() - start
        rates[batch] = batch * 32 / (full - two)  # decode tokens only: subtract prefill + first token
    return rates


def llama_cpp_server(cache_prompt: bool, path: str | None = None):
    """llama.cpp (xllamacpp's prebuilt wheel) serving the same GGUF (path; None: the default model) with the
    same thread count, one slot; None when xllamacpp is missing."""
    try:
        import xllamacpp
    except ImportError:
        return None
    threads = torch.get_num_threads()
    params = xllamacpp.CommonParams()
    params.model.path = path or default_model_path()
    params.n_ctx = 1024
    params.n_batch = params.n_ubatch = 512
    params.n_parallel = 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    params.cache_prompt = cache_prompt
    params.verbosity = 0
    return xllamacpp.Server(params)


def llama_cpp_rates(path: str | None = None, vocab: int = 49152) -> dict | None:
    """llama.cpp built for this CPU (tests/bench/llama_cpp_native.py: built once into a cache) on the same
    GGUF (path; None: the default model) and thread count, in a fresh process: prefill 512 and decode 1
    stream tokens/s (3 of each), prompt ids below vocab. None where it cannot be built here."""
    try:
        system = llama_cpp_native.ensure(log=lambda m: print(m, file=sys.stderr))
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"llama.cpp for this CPU not built: {exc}", file=sys.stderr)
        return None
    out = llama_cpp_native.measure(
        path or default_model_path(), torch.get_num_threads(), batch=0, vocab=vocab
    )
    return {"prefill": out["prefills"], "decode": out["decodes"], "system": system}


def _matmul_level() -> str:
    lib = native_kernels.load()
    if lib is None:
        return "none (no C kernels: PyTorch paths)"
    return {2: "AVX-512 VNNI", 1: "AVX2"}.get(lib.quantized_matmul_vectorized(), "none (portable C loops)")


def run() -> dict:
    bandwidth = memory_bandwidth()
    rows = []
    notes = [
        f"memory read bandwidth measured now: {bandwidth / 1e9:.1f} GB/s",
        f"threads: {torch.get_num_threads()}",
        f"packed matmul vector loops: {_matmul_level()}",
    ]
    cpp_runs = [llama_cpp_rates()]
    if cpp_runs[0] is None:
        notes.append(
            "llama.cpp column skipped: llama.cpp could not be built for this CPU (a compiler and cmake "
            "are needed; tests/bench/llama_cpp_native.py)"
        )
    fp32_ppl = None
    perplexities: dict[str, float] = {}
    ceilings = {dtype: matmul_flops(getattr(torch, dtype)) for dtype in dict.fromkeys(d for d, _ in CONFIGS)}
    for dtype, quantization in CONFIGS:
        flops = ceilings[dtype]
        engine = Engine.from_pretrained(
            dtype=dtype,
            device="cpu",
            kv_cache_bytes=1 << 30,
            quantization=quantization,
            max_num_seqs=64,
            max_num_batched_tokens=512,
        )
        label = dtype if quantization == "none" else f"{dtype}+{quantization}"
        weight_bytes = engine.model.weight_bytes
        params_per_token = engine.model.layer_parameters
        prefill_ceiling = flops / (2 * params_per_token)
        decode_ceiling = bandwidth / weight_bytes
        ppl = perplexity(engine)
        fp32_ppl = fp32_ppl or ppl
        perplexities[label] = ppl
        text_ids = engine.tokenizer.encode(FIXED_TEXT)
        notes.append(
            f"{label}: matmul {flops / 1e9:.0f} GFLOP/s, weights {weight_bytes / 1e6:.0f} MB, "
            f"perplexity {ppl:.3f} ({ppl / fp32_ppl:.4f}x float32)"
        )
        pf = prefill_rate(engine)
        hf = transformers_rates(dtype) if quantization == "none" else {}
        rows.append(
            {
                "dtype": label,
                "what": "prefill 512 tok",
                "tokens/s": pf,
                "ceiling": prefill_ceiling,
                "of ceiling": pf / prefill_ceiling,
                "transformers": hf.get("prefill"),
                "vs transformers": pf / hf["prefill"] if hf else None,
                "vs llama.cpp": "prefill",
            }
        )
        for batch in BATCHES:
            rate, fill = decode_rate(engine, batch)
            # a step reads every weight once (bandwidth-bound) and does 2 FLOP per parameter per token
            ceiling = min(
                batch * decode_ceiling, flops / (2 * (params_per_token + engine.model.lm_head_parameters))
            )
            rows.append(
                {
                    "dtype": label,
                    "what": f"decode x{batch}",
                    "tokens/s": rate,
                    "ceiling": ceiling,
                    "of ceiling": rate / ceiling,
                    "transformers": hf.get(batch),
                    "vs transformers": rate / hf[batch] if batch in hf else None,
                    "vs llama.cpp": "decode" if batch == 1 else None,
                    "KV live fill": fill,
                }
            )
            if batch == 32:
                sampled, _ = decode_rate(engine, batch, temperature=0.8, top_p=0.9)
                rows.append(
                    {
                        "dtype": label,
                        "what": "decode x32, T 0.8 top-p 0.9",
                        "tokens/s": sampled,
                        "of ceiling": sampled / ceiling,
                        "vs greedy": sampled / rate,
                    }
                )
        del engine
    cpp = None
    if cpp_runs[0] is not None:
        cpp_runs.append(llama_cpp_rates())
        cpp = {k: statistics.median(x for run in cpp_runs for x in run[k]) for k in ("prefill", "decode")}
        notes.append(
            f"llama.cpp (built for this CPU, same GGUF, same threads, medians of 6): prefill 512 "
            f"{cpp['prefill']:.0f} tok/s, decode x1 {cpp['decode']:.1f} tok/s; its build: {cpp_runs[0]['system']}"
        )
        try:
            cpp_ppl = llama_cpp_perplexity(llama_cpp_server(cache_prompt=True), text_ids)
        # another xllamacpp's replies (the bench extra is not pinned above): a note, not a failed bench
        except (KeyError, IndexError, TypeError, RuntimeError) as exc:
            notes.append(f"llama.cpp perplexity not measured: {type(exc).__name__}: {exc}")
        else:
            notes.append(
                f"perplexity on the same text ({len(text_ids)} tokens) and GGUF: llama.cpp {cpp_ppl:.3f}; "
                + ", ".join(
                    f"{label} {ppl:.3f} ({ppl / cpp_ppl:.4f}x llama.cpp)"
                    for label, ppl in perplexities.items()
                )
            )
    for row in rows:
        if row.get("vs llama.cpp"):
            what = row["vs llama.cpp"]
            row["llama.cpp"] = cpp[what] if cpp else None
            row["vs llama.cpp"] = row["tokens/s"] / cpp[what] if cpp else None
    return {"title": "Offline engine: prefill and decode throughput (CPU)", "rows": rows, "notes": notes}
