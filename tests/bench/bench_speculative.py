"""Speculative decoding (n-gram proposals): generated tokens/s with it and without, on three workloads.

copy       rewrite a given ~400-token text word for word (the output copies the prompt)
multiturn  a chat whose last turn asks to repeat an earlier answer with a line added
free       free writing (little to copy: the proposer should cost next to nothing)

Each at 1 stream and 32 streams (32 requests of the workload at once), with speculation off and on
(the default config: {"method": "ngram", "num_speculative_tokens": 5}, which stops proposing while
disable_by_batch_size or more requests run), alternated in rounds on one loaded model (the machine is
shared). The crossover rows force proposals on at 2 and 8 streams of the copy workload to show
where verification stops paying. Greedy decoding, max_tokens MAX_TOKENS, ignore_eos.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time

from runtime import Engine, SamplingParams

MAX_TOKENS = 64
ROUNDS = 2
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
ANSWER = (
    "To make a good cup of tea, first boil fresh cold water. Warm the teapot with a little hot water and "
    "pour it away. Add one teaspoon of loose tea per cup, plus one for the pot. Pour the water over the "
    "leaves just as it boils, let it steep for three to five minutes, then stir and pour through a "
    "strainer. Add milk or lemon to taste."
)


def _workloads(engine: Engine) -> dict[str, list[int]]:
    chat = engine.tokenizer.apply_chat_template
    return {
        "copy": chat(
            [{"role": "user", "content": f"Rewrite the following text word for word:\n\n{PASSAGE}"}],
            tokenize=True,
        ),
        "multiturn": chat(
            [
                {"role": "user", "content": "How do I make a good cup of tea?"},
                {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": "Thanks! Tell me about coffee, too."},
                {"role": "assistant", "content": "Brew coffee with water just off the boil, about 93 C."},
                {"role": "user", "content": "Please repeat your tea instructions exactly, then add a tip."},
            ],
            tokenize=True,
        ),
        "free": chat(
            [{"role": "user", "content": "Write a short story about a dragon who learns to paint."}],
            tokenize=True,
        ),
    }


def _tokens_per_second(engine: Engine, prompt: list[int], streams: int) -> float:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate([prompt] * streams, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds


def _cpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return ", ".join(
        f"{k.strip()} {fields[k].strip()}" for k in ("Model name", "CPU family", "Model") if k in fields
    )


def run() -> dict:
    base = Engine.from_pretrained(kv_cache_bytes=512 << 20, max_num_seqs=32)
    off = Engine(base.model, base.tokenizer, kv_cache_bytes=512 << 20, max_num_seqs=32)
    on = Engine(
        base.model, base.tokenizer, kv_cache_bytes=512 << 20, max_num_seqs=32, speculative_config=NGRAM
    )
    forced = Engine(
        base.model,
        base.tokenizer,
        kv_cache_bytes=512 << 20,
        max_num_seqs=32,
        speculative_config=NGRAM | {"disable_by_batch_size": 1000},
    )
    workloads = _workloads(base)
    cases = [(w, s, on) for w in workloads for s in (1, 32)] + [("copy", s, forced) for s in (2, 8)]
    _tokens_per_second(off, workloads["free"], 1)  # warm up
    rows = []
    for workload, streams, engine in cases:
        prompt = workloads[workload]
        spec, plain = [], []
        before = engine.stats()
        for _ in range(ROUNDS):
            plain.append(_tokens_per_second(off, prompt, streams))
            spec.append(_tokens_per_second(engine, prompt, streams))
        after = engine.stats()
        drafts = after.spec_num_drafts - before.spec_num_drafts
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        rows.append(
            row := {
                "workload": workload,
                "streams": streams,
                "proposals": "forced on" if engine is forced else "default",
                "off tok/s": statistics.median(plain),
                "on tok/s": statistics.median(spec),
                "speedup": statistics.median(spec) / statistics.median(plain),
                "accept len": 1 + accepted / drafts if drafts else None,
            }
        )
        print(row, file=sys.stderr, flush=True)  # a long run's rows survive an interruption
    return {
        "title": f"Speculative decoding (n-gram), {base.model_name}, {base.model.dtype}",
        "rows": rows,
        "notes": [
            f"CPU: {_cpu()}; {ROUNDS} rounds alternated, medians; max_tokens {MAX_TOKENS}, greedy",
            "accept len: tokens per verifying step (1 + accepted proposals per verification)",
            "the machine is shared with other sessions: figures are noisy",
        ],
    }
