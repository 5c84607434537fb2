"""Shared, expensive fixtures: the engine in float32 and transformers' reference model, loaded once."""

from __future__ import annotations

import pytest
import torch

from runtime import Engine

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
]


@pytest.fixture(scope="session")
def engine_fp32() -> Engine:
    return Engine.from_pretrained(dtype="float32", device="cpu", kv_cache_bytes=256 << 20)


@pytest.fixture(scope="session")
def reference(transformers_dir):
    """transformers loading the same GGUF file: an implementation independent of ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(transformers_dir)
    # transformers' GGUF reader gives every byte-level BPE GPT-2's split and ignores tokenizer.ggml.pre
    # ("smollm"): put back the digit split of SmolLM2's own tokenizer.json, which llama.cpp applies too
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    model = AutoModelForCausalLM.from_pretrained(transformers_dir, dtype=torch.float32)
    model.eval()
    return tokenizer, model


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
    """Greedy decoding with transformers' forward and its own KV cache (no generate() logits processors)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if len(tokens) == max_new_tokens or token == stop_id:
            return tokens
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
