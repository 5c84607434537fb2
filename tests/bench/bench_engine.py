"""Offline engine throughput against the roofline and transformers, measured in the same run.

prefill: one 512-token prompt, tokens/s of the prompt.
decode: N concurrent sequences generating together; total generated tokens/s over steps that only decode.
Ceilings: decode = min(N x memory bandwidth / weight bytes, matmul FLOP/s / (2 x parameters)): a
step reads every weight once and spends 2 FLOP per parameter per sequence;
prefill = matmul FLOP/s / (2 x parameters per token).
"""
from __future__ import annotations

import os
import random
import statistics
import time

import torch

from runtime import Engine, SamplingParams
from runtime.checkpoint import default_model_path
from tests.bench.roofline import matmul_flops, memory_bandwidth

DTYPES = ["float32", "bfloat16"]
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


def decode_rate(engine: Engine, batch: int) -> tuple[float, float]:
    """(tokens/s over decode-only steps, fraction of allocated KV slots holding live tokens)."""
    for i in range(batch):
        engine.add_request(None, _prompt(engine, 64, 100 + i),
                           SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True))
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
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=getattr(torch, dtype)).eval()
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


def run() -> dict:
    bandwidth = memory_bandwidth()
    rows = []
    notes = [f"memory read bandwidth measured now: {bandwidth / 1e9:.1f} GB/s"]
    for dtype in DTYPES:
        flops = matmul_flops(getattr(torch, dtype))
        engine = Engine.from_pretrained(dtype=dtype, device="cpu", kv_cache_bytes=1 << 30,
                                        max_num_seqs=64, max_num_batched_tokens=512)
        weight_bytes = engine.model.weight_bytes
        params_per_token = sum(t.numel() for layer in engine.model.layers
                               for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
        prefill_ceiling = flops / (2 * params_per_token)
        decode_ceiling = bandwidth / weight_bytes
        notes.append(f"{dtype}: matmul {flops / 1e9:.0f} GFLOP/s, weights {weight_bytes / 1e6:.0f} MB")
        pf = prefill_rate(engine)
        hf = transformers_rates(dtype)
        rows.append({"dtype": dtype, "what": "prefill 512 tok", "tokens/s": pf, "ceiling": prefill_ceiling,
                     "of ceiling": pf / prefill_ceiling, "transformers": hf["prefill"],
                     "vs transformers": pf / hf["prefill"]})
        for batch in BATCHES:
            rate, fill = decode_rate(engine, batch)
            # a step reads every weight once (bandwidth-bound) and does 2 FLOP per parameter per token
            ceiling = min(batch * decode_ceiling, flops / (2 * (params_per_token + engine.model.lm_head.numel())))
            rows.append({"dtype": dtype, "what": f"decode x{batch}", "tokens/s": rate,
                         "ceiling": ceiling, "of ceiling": rate / ceiling,
                         "transformers": hf.get(batch), "vs transformers": rate / hf[batch] if batch in hf else None,
                         "KV live fill": fill})
        del engine
    return {"title": "Offline engine: prefill and decode throughput (CPU)", "rows": rows, "notes": notes}
