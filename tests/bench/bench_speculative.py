"""Speculative decoding (n-gram proposals by default): generated tokens/s with it and without, on three
workloads.

copy       rewrite a given ~300-token text word for word (the output copies the prompt): max_tokens the
           text's length in tokens, the length of the rewrite asked for
multiturn  a chat whose history holds the model's own earlier answers (generated greedily at the start,
           at most HISTORY_TOKENS each), its last turn asking to repeat one with a tip added
free       free writing (little to copy: the proposer should cost next to nothing)

Each at 1 stream and 32 streams (32 requests of the workload at once), with speculation off and on
(the default config: {"method": "ngram", "num_speculative_tokens": 5}, which stops proposing while
disable_by_batch_size or more requests run), alternated in rounds on one loaded model (the machine is
shared). The crossover rows force proposals on at `crossover` streams (default 2, 4, 8) of the copy and
multi-turn workloads to show where verification stops paying. Greedy decoding, max_tokens MAX_TOKENS
(copy: the passage's tokens), ignore_eos.

The step-cost rows time one stream's engine step with 0, 1, 3 and 5 proposals injected (1, 2, 4, 6 rows),
the verifying sequence run as decode rows (the runner's default) and as a prefill chunk (the way before),
alternated, medians of STEP_ROUNDS.

Options: --quantization=gguf|none|auto (default auto), --crossover=2,4,8, --parts=steps,workloads,crossover,
--model=PATH (default: the default model), --method=ngram|suffix|draft_model (draft_model: --draft=PATH, default
the model itself, which checks the mechanics: every proposal accepted, no speed to gain), --streams=1,32.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time

import torch

from runtime import Engine, SamplingParams
from runtime.runner.model_runner import ModelRunner

MAX_TOKENS = 64
HISTORY_TOKENS = 128
"""The multi-turn workload's earlier answers: at most this many tokens each."""
ROUNDS = 2
ONE_STREAM_ROUNDS = 6
"""One stream's rows take more rounds: a round is short, and a 3% target needs the spread narrowed."""
STEP_ROUNDS = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PASSAGE = (
    "The harbour town woke slowly on winter mornings. Before the sun cleared the eastern hills, the "
    "fishermen were already at the quay, coiling ropes and checking the nets they had mended the night "
    "before. The baker on Mill Street lit his ovens at four, and by six the smell of fresh bread had "
    "drifted down to the water, where it mixed with salt, diesel and the sharp cold of the sea. "
    "Children walked to the school on the hill in pairs, their breath visible in the air, while the "
    "older residents gathered in the small cafe by the church to read the newspaper and argue about the "
    "weather. The harbour master, a tall woman named Elena Varga, kept a careful log of every boat that "
    "left and returned. She had held the post for twenty-two years and could tell from the sound of an "
    "engine whether it needed repair. In spring the town changed. Tourists arrived on the coastal train, "
    "the cafe put tables outside, and the ferry to the islands began its summer timetable, three "
    "crossings a day instead of one. The fishermen complained about the crowds but sold more of their "
    "catch than in any other season. By October the visitors were gone again, the tables were stacked "
    "inside, and the town settled back into its quiet rhythm of tides, bread and weather reports. "
    "Nobody who lived there would have called it remarkable, yet most of them had never wanted to live "
    "anywhere else, and those who left usually came back within a few years."
)


def _chat(engine: Engine, messages: list[dict]) -> list[int]:
    """The messages as the model's prompt: its chat template, or for a base model (none) the turns as
    plain "User:" / "Assistant:" lines ending with the assistant's cue."""
    if engine.tokenizer.chat_template:
        return engine.tokenizer.apply_chat_template(messages, tokenize=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return engine.tokenizer.encode("\n\n".join(lines) + "\n\nAssistant:")


def _workloads(engine: Engine) -> dict[str, list[int]]:
    return {
        "copy": _chat(
            engine, [{"role": "user", "content": f"Rewrite the following text word for word:\n\n{PASSAGE}"}]
        ),
        "multiturn": _chat(engine, _conversation(engine)),
        "free": _chat(
            engine, [{"role": "user", "content": "Write a short story about a dragon who learns to paint."}]
        ),
    }


def _conversation(engine: Engine) -> list[dict]:
    """A chat whose history holds the model's own earlier answers (greedy, as a chat client would have
    received them), ending with a turn that asks it to repeat one of them with a line added."""
    messages = []
    for ask in ("How do I make a good cup of tea?", "Thanks! Tell me about coffee, too."):
        messages.append({"role": "user", "content": ask})
        prompt = _chat(engine, messages)
        out = engine.generate([prompt], SamplingParams(max_tokens=HISTORY_TOKENS, temperature=0))[0]
        answer = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    messages.append(
        {"role": "user", "content": "Please repeat your tea instructions exactly, then add a tip."}
    )
    return messages


def _tokens_per_second(
    engine: Engine, prompt: list[int], streams: int, max_tokens: int = MAX_TOKENS
) -> tuple[float, float]:
    """Generated tokens/s over the whole run (prefill included), and over its decode: the tokens after each
    stream's first, from the first stream's first token to the last one's last."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate([prompt] * streams, params)
    seconds = time.perf_counter() - start
    decoding = max(o.token_times[-1] for o in outs) - min(o.token_times[0] for o in outs)
    return sum(len(o.token_ids) for o in outs) / seconds, sum(len(o.token_ids) - 1 for o in outs) / decoding


def _weights(engine: Engine) -> str:
    """How the projections are held: packed GGUF blocks (the C decode loop) or dense."""
    w = engine.model.layers[0].qkv
    return "dense weights" if isinstance(w, torch.Tensor) else "packed weights"


def _cpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return ", ".join(
        f"{k.strip()} {fields[k].strip()}" for k in ("Model name", "CPU family", "Model") if k in fields
    )


def _step_costs(engine: Engine, prompt: list[int]) -> list[dict]:
    """One stream's step time at 1, 2, 4 and 6 rows (proposals injected: its own last tokens, mostly
    rejected), verification as decode rows and as a prefill chunk, alternated."""
    request = engine.add_request(
        "step-cost", prompt, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    )
    while request.num_computed_tokens < len(prompt):
        engine.step()
    for _ in range(3):
        engine.step()
    taken: dict[tuple[bool, int], list[float]] = {}
    try:
        for _ in range(STEP_ROUNDS):
            for as_decode in (False, True):
                ModelRunner.verify_as_decode = as_decode
                for rows in (1, 2, 4, 6):
                    request.spec_token_ids = list(request.all_token_ids[-(rows - 1) :]) if rows > 1 else []
                    start = time.perf_counter()
                    engine.step()
                    taken.setdefault((as_decode, rows), []).append(time.perf_counter() - start)
    finally:
        ModelRunner.verify_as_decode = True
        engine.abort_request("step-cost")
    one = statistics.median(taken[(True, 1)])
    out = []
    for rows in (1, 2, 4, 6):
        chunk, decode = (statistics.median(taken[(d, rows)]) for d in (False, True))
        out.append(
            {
                "workload": f"step, {rows} rows",
                "streams": 1,
                "as chunk ms": 1e3 * chunk,
                "as decode ms": 1e3 * decode,
                "decode / chunk": decode / chunk,
                "decode / 1 row": decode / one,
            }
        )
    return out


def _config(method: str, draft: str | None, model: str | None) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": NGRAM["num_speculative_tokens"]}
    if method == "draft_model":
        from runtime.model.checkpoint import default_model_path

        return {
            "method": "draft_model",
            "model": draft or model or default_model_path(),
            "num_speculative_tokens": 4,
        }
    raise ValueError(f"--method: one of ngram, suffix, draft_model, got {method!r}")


def run(
    quantization: str = "auto",
    crossover: str = "2,4,8",
    parts: str = "steps,workloads,crossover",
    model: str | None = None,
    method: str = "ngram",
    draft: str | None = None,
    streams: str = "1,32",
) -> dict:
    wanted = set(parts.split(","))
    spec = _config(method, draft, model)
    base = Engine.from_pretrained(model, quantization=quantization, kv_cache_bytes=512 << 20, max_num_seqs=32)
    off = Engine(base.model, base.tokenizer, kv_cache_bytes=512 << 20, max_num_seqs=32)
    on = Engine(
        base.model, base.tokenizer, kv_cache_bytes=512 << 20, max_num_seqs=32, speculative_config=spec
    )
    forced = Engine(
        base.model,
        base.tokenizer,
        kv_cache_bytes=512 << 20,
        max_num_seqs=32,
        speculative_config=spec | {"disable_by_batch_size": 1000},
    )
    for engine in (off, on, forced):  # touch every KV page now: first-use page faults would land in one side
        engine.runner.kv.pool.zero_()
    workloads = _workloads(base)
    lengths = {"copy": len(base.tokenizer.encode(PASSAGE))}  # the rewrite asked for; the others MAX_TOKENS
    rows = []
    if "steps" in wanted:
        rows += _step_costs(off, workloads["free"])
        for row in rows:
            print(row, file=sys.stderr, flush=True)
    cases = []
    if "workloads" in wanted:
        cases += [(w, int(s), on) for w in workloads for s in streams.split(",")]
    if "crossover" in wanted:
        cases += [(w, int(s), forced) for w in ("copy", "multiturn") for s in crossover.split(",")]
    _tokens_per_second(off, workloads["free"], 1)  # warm up
    for workload, streams, engine in cases:
        prompt = workloads[workload]
        spec, plain = [], []
        before = engine.stats()
        for _ in range(ONE_STREAM_ROUNDS if streams == 1 else ROUNDS):
            length = lengths.get(workload, MAX_TOKENS)
            plain.append(_tokens_per_second(off, prompt, streams, length))
            spec.append(_tokens_per_second(engine, prompt, streams, length))
        after = engine.stats()
        drafts = after.spec_num_drafts - before.spec_num_drafts
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        whole = [statistics.median(r[0] for r in runs) for runs in (plain, spec)]
        decode = [statistics.median(r[1] for r in runs) for runs in (plain, spec)]
        rows.append(
            row := {
                "workload": workload,
                "streams": streams,
                "max_tokens": length,
                "proposals": "forced on" if engine is forced else "default",
                "off tok/s": whole[0],
                "on tok/s": whole[1],
                "speedup": whole[1] / whole[0],
                "decode speedup": decode[1] / decode[0],
                "accept len": 1 + accepted / drafts if drafts else None,
            }
        )
        print(row, file=sys.stderr, flush=True)  # a long run's rows survive an interruption
    return {
        "title": f"Speculative decoding ({method}), {base.model_name}, {base.model.dtype}, {_weights(base)}",
        "rows": rows,
        "notes": [
            f"CPU: {_cpu()}; {ONE_STREAM_ROUNDS} rounds alternated at 1 stream, {ROUNDS} at more, medians; "
            f"max_tokens {MAX_TOKENS} (copy: "
            f"{lengths['copy']}, the passage's tokens), greedy",
            "accept len: tokens per verifying step (1 + accepted proposals per verification)",
            "speedup: generated tokens/s, prefill included; decode speedup: after each stream's first token",
            "the machine is shared with other sessions: figures are noisy",
        ],
    }
