"""Llama models with random weights, built by transformers, for checks and benchmarks that cannot carry the
default GGUF (a GPU machine here receives at most 64 MiB of files): transformers' model is the reference,
and the engine runs on a copy of the same weights. Token ids are words "w3", "w4", .. of a word-level
tokenizer; 0-2 are <unk>, <s>, </s>.

SMOLLM2_135M and LLAMA_1B are the shapes of SmolLM2-135M (the default model) and of a Llama 3.2 1B.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.model.checkpoint_types import TokenizerSource
from runtime.model_config import ModelConfig

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512,
    hidden_size=192,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def hf_llama(shape: dict, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """transformers' LlamaForCausalLM with random weights (its own initialisation, std scaled up so the
    logits are not nearly uniform), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, initializer_range=0.08)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def word_tokenizer(path: Path, vocab_size: int) -> TokenizerSource:
    """A word-level tokenizer.json of vocab_size words under `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return TokenizerSource(tokenizer_json=str(path / "tokenizer.json"), bos_token_id=1, eos_token_id=2)


def model_config(hf_model, name: str = "random-llama") -> ModelConfig:
    c = hf_model.config
    return ModelConfig(
        name=name,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        rope_theta=float(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"]),
        rms_norm_eps=c.rms_norm_eps,
        max_model_len=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def engine_for(hf_model, tmp: Path, dtype: torch.dtype, device: str, **settings):
    """An Engine over a copy of hf_model's weights (in `dtype`, on `device`); settings as Engine takes."""
    from runtime import Engine
    from runtime.model.model import LlamaModel
    from runtime.model.tokenizer import Tokenizer

    config = model_config(hf_model)
    weights = {name: t.detach().float().cpu().numpy() for name, t in hf_model.state_dict().items()}
    model = LlamaModel(config, weights, dtype, torch.device(device))
    del weights
    tokenizer = Tokenizer(word_tokenizer(tmp / "tokenizer", config.vocab_size))
    return Engine(model, tokenizer, None, **settings)
