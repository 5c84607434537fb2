"""A Hugging Face directory (config.json, safetensors, tokenizer.json) loads and matches transformers; one
whose config.json disagrees with its tensors, or asks for what is not supported, is refused naming it."""

from __future__ import annotations

import pytest
import torch

from runtime import Engine, SamplingParams
from tests.random_llama import llama_shape, save_llama_dir
from tests.runtime.conftest import reference_greedy


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, reference):
    ref_tok, _ = reference
    path = tmp_path_factory.mktemp("tiny-llama")
    # vocab, hidden, intermediate, layers, heads, kv heads, context, rope theta, rms eps, tied embeddings
    shape = llama_shape(ref_tok.vocab_size, 64, 160, 2, 4, 2, 512, 10000.0, 1e-6, False)
    model = save_llama_dir(path, shape, ref_tok, eos_token_id=2, bos_token_id=1)
    return path, model


def test_hf_directory_logits_and_tokens_match_transformers(hf_dir):
    path, ref_model = hf_dir
    engine = Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=8 << 20)
    assert engine.max_model_len == 512
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=True)
    with torch.no_grad():
        theirs = ref_model(torch.tensor([prompt])).logits[0]
    assert (engine.prompt_logits(prompt) - theirs).abs().max().item() < 1e-4
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(ref_model, prompt, 12)


def _tiny_dir(tmp_path, family: str, **changes):
    """A tiny random model of `family` saved as a directory, config.json then edited."""
    import json

    from tests.random_families import hf_model, save_hf_dir

    path = save_hf_dir(hf_model(family), tmp_path / family)
    cfg = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_config_that_disagrees_with_the_tensors_is_refused_naming_both(tmp_path):
    path = _tiny_dir(tmp_path, "qwen3", intermediate_size=256)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight'.*feed_forward_length 256"
    ):
        Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "RoPE scaling 'yarn'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_config_is_refused_naming_it(tmp_path, changes, named):
    path = _tiny_dir(tmp_path, "phi3" if "partial_rotary_factor" in changes else "llama3", **changes)
    with pytest.raises(ValueError, match=named):
        Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
