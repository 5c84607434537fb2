"""Tiny random models of every supported family, built by transformers, saved as a Hugging Face directory
and written as a GGUF the way llama.cpp's converter writes one (gguf-py's tensor name map, Llama's Q/K row
permutation, Gemma's 1 + w norms, llama3's rope_freqs, LongRoPE's factor tensors, the same metadata keys).

Each config makes its family's features matter: a sliding window shorter than the prompt, soft-caps that
bite, llama3 scaling and LongRoPE over a 32-token original context, head_dim != hidden / heads, two RoPE
bases, and biases and norm weights randomised after construction (transformers initialises them to 0 and
1, which would hide a missing bias or a wrong norm convention).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

VOCAB = 512
END_OF_TURN = VOCAB - 1
"""The GGUF vocabulary's <end_of_turn> (write_gguf)."""
PROMPT_LEN = 40
"""Prompt tokens of the tests: longer than the sliding windows and the 32-token original contexts."""
ORIGINAL_CONTEXT = 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=80,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.1,
    tie_word_embeddings=False,
)

FAMILIES = {
    "llama3": dict(
        cls="LlamaForCausalLM",
        config="LlamaConfig",
        head_dim=32,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=ORIGINAL_CONTEXT,
        ),
    ),
    "mistral": dict(cls="MistralForCausalLM", config="MistralConfig", head_dim=32, sliding_window=8),
    "qwen2": dict(cls="Qwen2ForCausalLM", config="Qwen2Config", rope_parameters=dict(rope_theta=1e6)),
    "qwen3": dict(cls="Qwen3ForCausalLM", config="Qwen3Config", head_dim=32),
    "gemma2": dict(
        cls="Gemma2ForCausalLM",
        config="Gemma2Config",
        head_dim=32,
        query_pre_attn_scalar=32,  # llama.cpp's rule for all but the 27B: the GGUF has no key for it
        sliding_window=8,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        cls="Gemma3ForCausalLM",
        config="Gemma3TextConfig",
        num_hidden_layers=6,  # llama.cpp's pattern: five sliding layers, then a global one
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        cls="Phi3ForCausalLM",
        config="Phi3Config",
        sliding_window=16,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=[1.0 + 0.1 * i for i in range(10)],
            long_factor=[1.0 + 0.9 * i for i in range(10)],
            original_max_position_embeddings=ORIGINAL_CONTEXT,
        ),
    ),
}
"""transformers class, config class and the family's settings over COMMON."""


def packable(family: str) -> dict:
    """hf_model overrides that make every width a multiple of 32 (int8 groups divide them) and head_dim a
    power of two (the Triton kernels' rule): COMMON's 80 is chosen to be neither."""
    extra: dict = dict(hidden_size=128, intermediate_size=128)
    if family == "phi3":  # LongRoPE's factors: one per frequency of head_dim 32
        rope = dict(FAMILIES[family]["rope_parameters"])
        rope.update(
            short_factor=[1.0 + 0.1 * i for i in range(16)], long_factor=[1.0 + 0.9 * i for i in range(16)]
        )
        extra["rope_parameters"] = rope
    return extra


def hf_model(family: str, seed: int = 0, **overrides):
    """transformers' model of this family with random weights, biases and norm weights, float32, eval;
    overrides: config fields over the family's."""
    import transformers

    spec = dict(FAMILIES[family]) | overrides
    cls, config_cls = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("config"))
    config = config_cls(**(COMMON | spec))
    if family == "qwen2":
        config.use_sliding_window = False
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.0 if "gemma" in family else 1.0))
    return model


def save_hf_dir(model, path: Path) -> Path:
    """config.json + model.safetensors + a word-level tokenizer.json."""
    from tests.random_llama import word_tokenizer

    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(path, model.config.vocab_size)
    return path


def _gpt2_vocab(size: int) -> list[str]:
    """A byte-level BPE vocabulary of `size` tokens with one merge, "! !" (token ids are what the tests
    feed; a BPE vocabulary without merges is refused, as llama.cpp refuses it), its last token an
    end-of-turn control token (END_OF_TURN) besides the EOS "</s>"."""
    singles = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0x100, 0x100 + 256 - 94)]
    tokens = ["<unk>", "<s>", "</s>"] + singles + ["!!"]
    return tokens + [f"t{i}" for i in range(size - len(tokens) - 1)] + ["<end_of_turn>"]


def _llama3_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs for llama3 scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, original = (
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["original_max_position_embeddings"],
    )
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    model,
    family: str,
    path: Path,
    overrides: dict | None = None,
    tokenizer_model: str = "gpt2",
    edit=None,
) -> Path:
    """The model as llama.cpp's converter would write it (float32 tensors). For tests of broken or
    unsupported files: overrides, header keys to set instead of the true values (e.g. {'embedding_length':
    8192}); tokenizer_model, tokenizer.ggml.model; edit(writer), called before the tensors are written (to
    add one)."""
    import gguf

    c = model.config
    arch = {"llama3": "llama", "mistral": "llama"}.get(family, family)
    gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = dict(c.rope_parameters)
    rope = rope.get("full_attention", rope)
    meta = dict(
        context_length=c.max_position_embeddings,
        embedding_length=c.hidden_size,
        block_count=c.num_hidden_layers,
        feed_forward_length=c.intermediate_size,
        head_count=c.num_attention_heads,
        head_count_kv=c.num_key_value_heads,
        layer_norm_rms_eps=c.rms_norm_eps,
        rope_freq_base=rope["rope_theta"],
        vocab_size=c.vocab_size,
    ) | (overrides or {})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(meta["context_length"])
    writer.add_embedding_length(meta["embedding_length"])
    writer.add_block_count(meta["block_count"])
    writer.add_feed_forward_length(meta["feed_forward_length"])
    writer.add_head_count(meta["head_count"])
    writer.add_head_count_kv(meta["head_count_kv"])
    writer.add_layer_norm_rms_eps(meta["layer_norm_rms_eps"])
    writer.add_rope_freq_base(meta["rope_freq_base"])
    writer.add_vocab_size(meta["vocab_size"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if getattr(c, "sliding_window", None) and family != "qwen2":
        writer.add_sliding_window(c.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if family == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        scale = c.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL_CONTEXT)))
    writer.add_tokenizer_model(tokenizer_model)
    tokens = _gpt2_vocab(c.vocab_size)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    writer.add_token_merges(["! !"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    names = gguf.get_tensor_name_map(gguf_arch, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise KeyError(f"gguf-py maps no tensor name for {name}")
        writer.add_tensor(new, np.ascontiguousarray(w))
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(head_dim, rope))
    if family == "phi3":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if edit is not None:
        edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
