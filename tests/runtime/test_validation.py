"""Bad input gets a ValueError that names the field and says the limit."""

from __future__ import annotations

import json

import pytest

from runtime import Engine, SamplingParams


def test_empty_prompt(engine_fp32):
    for prompt in ("", []):
        with pytest.raises(ValueError, match="prompt"):
            engine_fp32.generate([prompt], SamplingParams(max_tokens=4))


def test_prompt_longer_than_context(engine_fp32):
    too_long = [42] * engine_fp32.max_model_len
    with pytest.raises(ValueError, match=rf"prompt.*{engine_fp32.max_model_len}"):
        engine_fp32.add_request("long", too_long, SamplingParams(max_tokens=1))


def test_prompt_plus_max_tokens_beyond_context(engine_fp32):
    prompt = [42] * (engine_fp32.max_model_len - 10)
    with pytest.raises(ValueError, match=rf"max_tokens.*{engine_fp32.max_model_len}"):
        engine_fp32.add_request("long", prompt, SamplingParams(max_tokens=11))


def test_token_ids_out_of_vocabulary(engine_fp32):
    with pytest.raises(ValueError, match="prompt: token 1"):
        engine_fp32.add_request("bad", [5, 10**9], SamplingParams(max_tokens=1))


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Engine.from_pretrained(str(tmp_path / "missing"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="unsupported architecture"):
        Engine.from_pretrained(str(tmp_path))


@pytest.mark.slow  # loads the real model
def test_bad_engine_arguments():
    with pytest.raises(ValueError, match="dtype"):
        Engine.from_pretrained(dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine.from_pretrained(kv_cache_bytes=-1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine.from_pretrained(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine.from_pretrained(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="block_size"):
        Engine.from_pretrained(block_size=0)
    with pytest.raises(ValueError, match="kv_cache_bytes: too small"):
        Engine.from_pretrained(kv_cache_bytes=1024)
