"""Our model against transformers on the same GGUF: logits and greedy tokens in float32."""

from __future__ import annotations

import torch

from runtime import SamplingParams
from tests.runtime.conftest import CHATS, chat_ids, reference_greedy


def test_prefill_logits_match_transformers(engine_fp32, reference):
    ref_tok, ref_model = reference
    ids = chat_ids(engine_fp32.tokenizer, CHATS[0] + " And of Italy?")
    assert ids == ref_tok.apply_chat_template(
        [{"role": "user", "content": CHATS[0] + " And of Italy?"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    ours = engine_fp32.prompt_logits(ids)
    with torch.no_grad():
        theirs = ref_model(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)
        ).logits[0]
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-3, f"max logit difference {diff}"


def test_greedy_tokens_match_transformers(engine_fp32, reference):
    ref_tok, ref_model = reference
    prompts = [chat_ids(engine_fp32.tokenizer, c) for c in CHATS[:4]]  # batched together, each its length
    outs = engine_fp32.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected = reference_greedy(ref_model, prompt, 24)
        assert out.token_ids == expected, engine_fp32.tokenizer.decode(prompt)
        assert out.finish_reason == "length"


def test_stops_on_end_of_turn_like_transformers(engine_fp32, reference):
    ref_tok, ref_model = reference
    prompt = chat_ids(engine_fp32.tokenizer, "Say just the word 'yes'.")
    out = engine_fp32.generate([prompt], SamplingParams(max_tokens=64, temperature=0))[0]
    with torch.no_grad():
        ref = ref_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=ref_tok.eos_token_id,
            pad_token_id=ref_tok.eos_token_id,
        )
    expected = ref[0, len(prompt) :].tolist()
    assert expected[-1] == ref_tok.eos_token_id, "reference did not stop; pick another prompt"
    assert out.finish_reason == "stop"
    assert out.token_ids == expected
    assert out.text == ref_tok.decode(expected, skip_special_tokens=True)
