"""Read a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) into a Checkpoint.

Families: Llama (3.x llama3 RoPE scaling included), Mistral, Qwen 2/2.5, Qwen 3, Gemma 2, Gemma 3 (text),
Phi-3. config.json's fields become ModelConfig's features; tensor names become the Hugging Face Llama
names the model takes:

* Gemma's RMSNorms multiply by 1 + w (transformers stores w): 1 is added here, as llama.cpp's converter
  does, so the model multiplies by the stored weight in every format. Its post_attention_layernorm
  normalises the attention output (attn_output_norm here), pre_feedforward_layernorm is Llama's
  post_attention_layernorm (the MLP's input norm), post_feedforward_layernorm the MLP output's.
* Phi-3's fused qkv_proj and gate_up_proj are split by rows (the model fuses them again).

Shapes are checked against config.json from the safetensors headers before any tensor is read; each
tensor is then read when the model takes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from runtime.model.checkpoint_types import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_ROPE_THETA,
    Checkpoint,
    DeferredTensor,
    TokenizerSource,
    check_config,
    check_shapes,
    expected_shapes,
)
from runtime.model.rope_scaling import llama3_freq_factors, longrope_attention_factor
from runtime.model.tokenizer import check_tokenizer_source
from runtime.model_config import ModelConfig

MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
"""config.json's model_type -> the family (GGUF's architecture name)."""
HF_RMS_NORM_EPS = 1e-6
"""RMSNorm epsilon when config.json does not say (transformers' LlamaConfig default)."""
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
"""Every n-th layer attends globally (configs without layer_types: transformers' rule per family)."""
GEMMA3_LOCAL_ROPE_THETA = 10000.0
"""Gemma 3's sliding layers' RoPE base when config.json does not say (transformers' default)."""

_GEMMA_NAMES = (
    ("post_attention_layernorm", "attn_output_norm"),
    ("pre_feedforward_layernorm", "post_attention_layernorm"),
    ("post_feedforward_layernorm", "mlp_output_norm"),
)


def read_hf_dir(path: Path) -> Checkpoint:
    """config.json, *.safetensors and tokenizer.json (+ tokenizer_config.json, generation_config.json)."""
    cfg = json.loads((path / "config.json").read_text())
    where = str(path / "config.json")
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model: unsupported architecture {cfg.get('architectures') or model_type!r} (model_type "
            f"{model_type!r}) in {where}; supported model types: {', '.join(MODEL_TYPES)}"
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
    arch = MODEL_TYPES[model_type]
    tensors = _tensor_index(files)
    config = _config(cfg, arch, path.name, "lm_head.weight" in tensors, where)
    check_config(config, where)
    weights, file_names = _weights(arch, tensors, config)
    check_shapes({n: w.shape for n, w in weights.items()}, config, where, file_names)
    expected = expected_shapes(config)
    weights = {n: w for n, w in weights.items() if n in expected}
    return Checkpoint(config, weights, source)


def _rope_parameters(cfg: dict) -> tuple[dict, dict | None]:
    """(global layers' RoPE parameters, sliding layers' or None): config.json's rope_scaling /
    rope_parameters, flat or keyed by layer type (transformers 5), with rope_theta folded in."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        params, local = params.get("full_attention") or {}, params.get("sliding_attention")
    params = dict(params)
    params.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    if local is None and cfg.get("rope_local_base_freq") is not None:
        local = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return params, local


def _config(cfg: dict, arch: str, name: str, has_lm_head: bool, where: str) -> ModelConfig:
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    context = int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
    rope, local = _rope_parameters(cfg)
    if any(float(d.get("partial_rotary_factor") or 1.0) != 1.0 for d in (rope, cfg)):
        raise ValueError(
            f"model: {where}: partial rotary embeddings (partial_rotary_factor) are not supported"
        )
    features: dict = _rope_features(rope, head_dim, context, cfg, where)
    if arch == "gemma3":
        theta_local = float((local or {}).get("rope_theta", GEMMA3_LOCAL_ROPE_THETA))
        features["rope_theta_local"] = theta_local
    window = cfg.get("sliding_window")
    if window is not None and (arch != "qwen2" or cfg.get("use_sliding_window")):
        features["sliding_window"] = int(window)
        types = cfg.get("layer_types")
        if types:
            features["sliding_layers"] = tuple(t == "sliding_attention" for t in types)
        elif arch == "qwen2":  # layers from max_window_layers on slide (transformers' rule)
            first = cfg.get("max_window_layers", layers)
            features["sliding_layers"] = tuple(i >= first for i in range(layers))
        elif arch in SLIDING_PATTERN:  # configs from before layer_types: every n-th layer is global
            n = int(cfg.get("sliding_window_pattern") or SLIDING_PATTERN[arch])
            features["sliding_layers"] = tuple(i % n < n - 1 for i in range(layers))
    if arch == "qwen2" or cfg.get("attention_bias"):
        features["qkv_bias"] = True
    if arch in ("qwen3", "gemma3"):
        features["qk_norm"] = True
    if arch in ("gemma2", "gemma3"):
        features |= dict(
            sandwich_norms=True,
            hidden_act="gelu_tanh",
            embed_scale=math.sqrt(hidden),
            attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"model: {where}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)"
            )
    elif cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: {where}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    return ModelConfig(
        name=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", HF_RMS_NORM_EPS)),
        max_model_len=context,
        tie_word_embeddings=not has_lm_head,
        architecture=arch,
        quantization="none",
        **features,
    )


def _rope_features(rope: dict, head_dim: int, context: int, cfg: dict, where: str) -> dict:
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope["rope_theta"])
    if kind in ("default", None):
        return {}
    if kind == "linear":
        return {"rope_linear_factor": float(rope["factor"])}
    if kind == "llama3":
        factors = llama3_freq_factors(
            head_dim,
            theta,
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
        return {"rope_freq_factors": factors}
    if kind in ("longrope", "su"):
        original = int(
            rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        )
        chosen = rope["long_factor"] if context > original else rope["short_factor"]
        attention = rope.get("attention_factor")
        if attention is None:
            factor = rope.get("factor")
            attention = (
                longrope_attention_factor(context, original)
                if factor is None
                else longrope_attention_factor(int(factor * original), original)
            )
        return {
            "rope_freq_factors": tuple(float(f) for f in chosen),
            "rope_attention_factor": float(attention),
        }
    raise ValueError(f"model: {where}: RoPE scaling {kind!r} (rope_type) is not supported")


def _tensor_index(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape), from the safetensors headers only."""
    from safetensors import safe_open

    index = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                index[name] = (f, tuple(st.get_slice(name).get_shape()))
    return index


def _weights(arch: str, tensors: dict, config: ModelConfig):
    """(canonical name -> DeferredTensor, canonical name -> the file's own name)."""
    weights: dict[str, DeferredTensor] = {}
    file_names: dict[str, str] = {}
    c = config
    for name, (f, shape) in tensors.items():
        canonical = name
        add_one = arch in ("gemma2", "gemma3") and name.endswith("norm.weight")
        if arch in ("gemma2", "gemma3"):
            for theirs, ours in _GEMMA_NAMES:
                if f".{theirs}." in name:
                    canonical = name.replace(theirs, ours)
                    break
        splits = None
        if arch == "phi3" and ".self_attn.qkv_proj." in name:
            bounds = [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
            splits = [
                (name.replace("qkv_proj", p), lo, hi)
                for p, lo, hi in zip(("q_proj", "k_proj", "v_proj"), bounds, bounds[1:])
            ]
        elif arch == "phi3" and ".mlp.gate_up_proj." in name:
            half = shape[0] // 2
            splits = [
                (name.replace("gate_up_proj", "gate_proj"), 0, half),
                (name.replace("gate_up_proj", "up_proj"), half, shape[0]),
            ]
        for out, lo, hi in splits or [(canonical, None, None)]:
            out_shape = shape if lo is None else (hi - lo, *shape[1:])
            weights[out] = DeferredTensor(out_shape, _loader(f, name, lo, hi, add_one))
            file_names[out] = name
    return weights, file_names


def _loader(path: Path, name: str, lo: int | None, hi: int | None, add_one: bool):
    """Reads one tensor (rows [lo, hi)) as float32 numpy when called (bf16 has no numpy dtype: via torch)."""

    def load() -> np.ndarray:
        import torch
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as st:
            t = st.get_tensor(name) if lo is None else st.get_slice(name)[lo:hi]
        w = t.to(torch.float32).numpy()
        return w + np.float32(1.0) if add_one else w

    return load
