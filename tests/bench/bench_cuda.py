"""The engine on a CUDA GPU against the GPU's own ceilings and transformers, measured in the same run.

Skipped (no rows) where torch sees no CUDA device: CI and the CPU machines here have none.

Models: random weights in two shapes, SmolLM2-135M's (the default model) and a Llama 3.2 1B's
(tests/random_llama.py; the GGUF cannot travel to the GPU machine), bfloat16, built once by transformers;
the engine runs a copy of the same weights. Speed does not depend on the weights' values.
Ceilings, measured at the start: memory bandwidth (a 2 GiB device-to-device copy, bytes read + written)
and the bfloat16 matmul rate (8192 x 8192 x 8192). Decode at N sequences: min(N x bandwidth / weight
bytes, matmul rate / (2 x parameters)) tokens/s; prefill: matmul rate / (2 x parameters).
Decode rows: tokens/s over steps that only decode (bench_engine.decode_rate); prefill: one 512-token
prompt (bench_engine.prefill_rate). Each with the step replayed from CUDA graphs and with the same engine run
eagerly (enforce_eager's path), against transformers (bfloat16; generate with its default cache for decode,
one forward for prefill) on the same weights.
Attention: the Triton decode kernel against PyTorch's gather + matmul decode on one layer's pool,
64 sequences of 1024 tokens, SmolLM2's heads: GPU time of 10 calls captured in a CUDA graph, median of 20
replays (the calls' own host launches would dominate otherwise).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from tests.bench.bench_engine import decode_rate, prefill_rate
from tests.random_llama import LLAMA_1B, SMOLLM2_135M, engine_for, hf_llama

SHAPES = [("SmolLM2-135M", SMOLLM2_135M), ("Llama-1B", LLAMA_1B)]
BATCHES = [1, 16, 64]


def cuda_seconds(fn, repeat: int = 50, warmup: int = 5) -> float:
    """Median seconds of fn on the GPU, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_seconds(fn, repeat: int = 20, inner: int = 10) -> float:
    """Median seconds of fn's GPU work alone: `inner` calls captured in a CUDA graph, replayed (timing the
    calls themselves would time the host's launches, tens of microseconds each on a small kernel)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return cuda_seconds(graph.replay, repeat=repeat) / inner


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_seconds(lambda: dst.copy_(src), repeat=20)


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / cuda_seconds(lambda: a @ b, repeat=20)


def transformers_rates(model, vocab: int) -> dict:
    """transformers on the GPU: prefill tokens/s (one forward over 512 tokens), decode tokens/s at each batch
    (generate 34 tokens minus generate 2: the decode steps alone)."""
    rates = {}
    prompt = torch.randint(100, vocab, (1, 512), device="cuda")
    with torch.no_grad():
        model(prompt)
        torch.cuda.synchronize()
        rates["prefill"] = 512 / cuda_seconds(lambda: model(prompt), repeat=5, warmup=1)
    for batch in BATCHES:
        ids = torch.randint(100, vocab, (batch, 64), device="cuda")
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
            seconds = {}
            for n in (2, 34):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
                torch.cuda.synchronize()
                seconds[n] = time.perf_counter() - start
        rates[batch] = batch * 32 / (seconds[34] - seconds[2])
    return rates


def attention_row(bandwidth: float) -> dict:
    from runtime.attention.torch_backend import _decode
    from runtime.kernels.triton_attention import decode_attention

    seqs, length, heads, kv_heads, d, bs = 64, 1024, 9, 3, 64, 8
    blocks = seqs * length // bs
    k = torch.randn(blocks, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(blocks, device="cuda").view(seqs, -1)
    lens = torch.full((seqs,), length, device="cuda")
    q = torch.randn(seqs, heads, d, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(seqs, 1, 1, length, device="cuda")
    fused = graph_seconds(lambda: decode_attention(q, k, v, tables, lens, d**-0.5))
    gathered = graph_seconds(lambda: _decode(q, k, v, tables, bias, d**-0.5))
    kv_bytes = 2 * k.numel() * k.element_size()
    return {
        "case": "attention 64 x 1024 (one layer)",
        "prescient": f"{fused * 1e6:.1f} us",
        "baseline": f"{gathered * 1e6:.1f} us (PyTorch gather + matmul)",
        "ratio": round(gathered / fused, 2),
        "of_ceiling": round(kv_bytes / fused / bandwidth, 2),
    }


def run() -> dict:
    title = "CUDA engine (bfloat16, CUDA graphs, Triton attention) vs the GPU's ceilings and transformers"
    if not torch.cuda.is_available():
        return {"title": title, "rows": [], "notes": ["skipped: torch sees no CUDA device on this machine"]}
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    gpu = torch.cuda.get_device_name()
    rows = [
        {"case": "memory bandwidth (copy)", "prescient": f"{bandwidth / 1e12:.2f} TB/s"},
        {"case": "bf16 matmul 8192^3", "prescient": f"{flops / 1e12:.0f} TFLOP/s"},
    ]
    notes = [f"{gpu}; torch {torch.__version__}"]
    tmp = Path(tempfile.mkdtemp())
    for name, shape in SHAPES:
        hf = hf_llama(shape, "cuda", torch.bfloat16)
        theirs = transformers_rates(hf, shape["vocab_size"])
        engine = engine_for(
            hf, tmp, torch.bfloat16, "cuda", max_num_seqs=max(BATCHES), kv_cache_bytes=4 << 30
        )
        del hf
        torch.cuda.empty_cache()
        model = engine.model
        weight_bytes = model.weight_bytes
        params = model.layer_parameters + model.lm_head_parameters
        compute_cap = flops / (2 * params)
        graphs = engine.runner.graphs
        prefill = prefill_rate(engine)
        engine.runner.graphs = None
        prefill_eager = prefill_rate(engine)
        engine.runner.graphs = graphs
        rows.append(
            {
                "case": f"{name} prefill 512",
                "prescient": round(prefill),
                "baseline": f"{theirs['prefill']:,.0f} (transformers); eager {prefill_eager:,.0f}",
                "ratio": round(prefill / theirs["prefill"], 2),
                "of_ceiling": round(prefill / compute_cap, 3),
            }
        )
        for batch in BATCHES:
            cap = min(batch * bandwidth / weight_bytes, compute_cap)
            replayed, _ = decode_rate(engine, batch)
            engine.runner.graphs = None
            eager, _ = decode_rate(engine, batch)
            engine.runner.graphs = graphs
            rows.append(
                {
                    "case": f"{name} decode x{batch}",
                    "prescient": round(replayed),
                    "baseline": f"{theirs[batch]:,.0f} (transformers); eager {eager:,.0f}",
                    "ratio": round(replayed / theirs[batch], 2),
                    "of_ceiling": round(replayed / cap, 3),
                }
            )
        notes.append(
            f"{name}: {weight_bytes / 1e6:,.0f} MB of weights a decode step reads, {params / 1e6:,.0f} M "
            f"parameters; ceilings: decode x1 {bandwidth / weight_bytes:,.0f} tok/s, compute "
            f"{compute_cap:,.0f} tok/s"
        )
        del engine, model, graphs
        torch.cuda.empty_cache()
    rows.append(attention_row(bandwidth))
    return {"title": title, "rows": rows, "notes": notes, "gpu": gpu}
