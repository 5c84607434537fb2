"""A generation ends on every end-of-generation token the vocabulary declares (Tokenizer.eog_token_ids:
EOS and end-of-turn tokens such as Gemma's <end_of_turn>, Llama 3's <|eot_id|>), with finish_reason "stop",
unless ignore_eos; min_tokens holds all of them back.

A tiny random model as a GGUF whose vocabulary declares <end_of_turn> besides its EOS (tests/random_families),
and the default SmolLM2 (EOS <|im_end|>, and <|endoftext|>). The model is steered onto the token with a
logit bias: which token a random model picks is not the point. The real Gemma 3 file: test_gemma3_gguf.py.
"""

from __future__ import annotations

import pytest
import torch

from runtime import Engine, SamplingParams
from tests.random_families import END_OF_TURN, PROMPT_LEN, VOCAB, hf_model, write_gguf


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = write_gguf(hf_model("llama3"), "llama3", tmp_path_factory.mktemp("eog") / "eog.gguf")
    return Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)


def _prompt() -> list[int]:
    return torch.randint(3, VOCAB - 1, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


def test_the_vocabulary_declares_eos_and_end_of_turn(engine):
    assert engine.tokenizer.eos_token_id == 2
    assert engine.tokenizer.eog_token_ids == [2, END_OF_TURN]


@pytest.mark.parametrize("token", [END_OF_TURN, 2])
def test_each_end_of_generation_token_stops(engine, token):
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={token: 100.0})
    out = engine.generate([_prompt()], params)[0]
    assert out.token_ids == [token] and out.finish_reason == "stop"
    assert "<end_of_turn>" not in out.text


def test_ignore_eos_runs_past_end_of_turn(engine):
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={END_OF_TURN: 100.0}, ignore_eos=True)
    out = engine.generate([_prompt()], params)[0]
    assert out.token_ids == [END_OF_TURN] * 5 and out.finish_reason == "length"


def test_min_tokens_holds_back_every_end_of_generation_token(engine):
    bias = {END_OF_TURN: 100.0, 2: 100.0}
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias=bias, min_tokens=3)
    out = engine.generate([_prompt()], params)[0]
    assert len(out.token_ids) == 4 and out.token_ids[3] in (2, END_OF_TURN) and out.finish_reason == "stop"
    assert not set(out.token_ids[:3]) & {2, END_OF_TURN}


def test_smollm2_stops_on_endoftext_as_on_its_eos(engine_fp32):
    tok = engine_fp32.tokenizer
    other = [t for t in tok.eog_token_ids if t != tok.eos_token_id]
    assert other and tok.decode(other, skip_special_tokens=False) == "<|endoftext|>"
    prompt = tok.encode("Hello")
    out = engine_fp32.generate([prompt], SamplingParams(max_tokens=8, logit_bias={other[0]: 100.0}))[0]
    assert out.token_ids == other and out.finish_reason == "stop"
