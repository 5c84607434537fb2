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

SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
)
"""The LlamaConfig keywords a shape sets, in the order of the table below."""


def llama_shape(*values) -> dict:
    """LlamaConfig keywords from the values of SHAPE_KEYS, in order."""
    return dict(zip(SHAPE_KEYS, values, strict=True))


# vocab, hidden, intermediate, layers, heads, kv heads, context, rope theta, rms eps, tied embeddings
SMOLLM2_135M = llama_shape(49152, 576, 1536, 30, 9, 3, 8192, 100000.0, 1e-5, True)
LLAMA_1B = llama_shape(128256, 2048, 8192, 16, 32, 8, 8192, 500000.0, 1e-5, True)
TINY = llama_shape(512, 192, 384, 3, 6, 2, 1024, 10000.0, 1e-6, False)


def hf_llama(shape: dict, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """transformers' LlamaForCausalLM with random weights (its own initialisation, std scaled up so the
    logits are not nearly uniform), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, initializer_range=0.08)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def save_llama_dir(path: Path, shape: dict, tokenizer, seed: int = 0, **config):
    """transformers' LlamaForCausalLM of `shape` and `config`, with its own random initialisation (from
    `seed`), saved with `tokenizer` (a transformers tokenizer) as a Hugging Face directory; the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, **config)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


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
