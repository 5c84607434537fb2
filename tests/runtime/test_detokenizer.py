"""The incremental detokenizer releases exactly what one decode of all the ids gives (the tokenizer itself is
the oracle), never a broken character mid-stream, and stops where the stop string starts."""

from __future__ import annotations

import random

from runtime.engine.detokenizer import Detokenizer

TEXTS = [
    "Plain English words, then numbers 12345 and punctuation!?",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🎉, Ελληνικά, עברית, and mixed ascii",
    "  leading spaces\n\nnew lines\ttabs   and trailing  ",
]


def test_incremental_text_equals_one_decode(engine_fp32):
    tok = engine_fp32.tokenizer
    rng = random.Random(0)
    sequences = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(200)] for _ in range(3)]  # arbitrary bytes
    for k, ids in enumerate(sequences):
        detok = Detokenizer(tok, [])
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n], n == len(ids))
            assert tok.decode(ids[:n]).startswith(detok.text)  # never ahead of the truth...
            if k < len(TEXTS):
                assert "\ufffd" not in detok.text  # ...never half a character...
        assert detok.text == tok.decode(ids)  # ...and exactly it at the end


def test_stop_string_cuts_the_text(engine_fp32):
    tok = engine_fp32.tokenizer
    ids = tok.encode("The answer is 42. END of the story", add_special_tokens=False)
    detok = Detokenizer(tok, ["END"])
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n], False)
        if detok.stop_reason is not None:
            break
        assert "END"[:1] not in detok.text[len("The answer is 42. ") :]  # the stop string is held back
    assert detok.stop_reason == "END" and detok.text == "The answer is 42. "
