"""Read a Hugging Face Llama-family checkpoint directory into a Checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.checkpoint_types import DEFAULT_CONTEXT_LENGTH, DEFAULT_ROPE_THETA, Checkpoint, TokenizerSource
from runtime.model_config import ModelConfig
from runtime.tokenizer import check_tokenizer_source

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
HF_RMS_NORM_EPS = 1e-6
"""RMSNorm epsilon when config.json does not say (transformers' LlamaConfig default)."""


def read_hf_dir(path: Path) -> Checkpoint:
    """config.json, *.safetensors and tokenizer.json (+ tokenizer_config.json, generation_config.json)."""
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES or (
        archs and archs[0] not in SUPPORTED_ARCHITECTURES
    ):
        raise ValueError(
            f"model: unsupported architecture {archs or cfg.get('model_type')!r} in "
            f"{path / 'config.json'}; supported: Llama-family decoders "
            f"{SUPPORTED_ARCHITECTURES}"
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r}")
    if not (path / "tokenizer.json").exists():
        raise ValueError(f"model: no tokenizer.json in {str(path)!r}")
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    gen_cfg_path = path / "generation_config.json"
    if gen_cfg_path.exists():
        gen_eos = json.loads(gen_cfg_path.read_text()).get("eos_token_id")
        eos = gen_eos[0] if isinstance(gen_eos, list) else (gen_eos if gen_eos is not None else eos)
    source = TokenizerSource(
        tokenizer_json=str(path / "tokenizer.json"),
        chat_template=template,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        add_eos_token=bool(tok_cfg.get("add_eos_token", False)),
    )
    check_tokenizer_source(source)  # before any weight is read
    rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) not in ("default", None):
        raise ValueError(f"model: rope scaling {rope_scaling!r} is not supported")
    heads = cfg["num_attention_heads"]
    config = ModelConfig(
        name=path.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta", rope_scaling.get("rope_theta", DEFAULT_ROPE_THETA))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", HF_RMS_NORM_EPS)),
        max_model_len=int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    weights: dict[str, np.ndarray] = {}
    for f in files:
        for name, array in _load_safetensors(f).items():
            weights[name] = array
    return Checkpoint(config, weights, source)


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """bf16 has no numpy dtype: read through torch, then hand back float32 numpy arrays."""
    import torch
    from safetensors.torch import load_file

    return {name: t.to(torch.float32).numpy() for name, t in load_file(str(path)).items()}
