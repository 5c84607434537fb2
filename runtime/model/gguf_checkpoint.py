"""Read a GGUF file (llama, qwen2, qwen3, gemma2, gemma3, phi3) into a Checkpoint.

Tensor names are llama.cpp's (gguf-py's gguf.constants); they are mapped to the Hugging Face Llama names
the model takes (checkpoint_types.expected_shapes), and each family's header keys to ModelConfig's
features. Per family, what llama.cpp's converter did to the weights is undone or kept:

* llama: Q and K rows permuted so that RoPE rotates interleaved pairs; un-permuted here to Hugging
  Face's half-split order, so one model implementation serves both sources (a wrong pairing still yields
  fluent text, which is why the tests compare logits). `rope_freqs` holds llama3 scaling's divisors.
* qwen2, qwen3, gemma2, gemma3, phi3: rotate halves (NEOX order) already: not permuted.
* gemma2/3: every RMSNorm weight stored as 1 + w, which is what the model multiplies by.
* phi3: Q/K/V fused in `attn_qkv`, gate and up in `ffn_up` (gate first); LongRoPE's divisors in
  `rope_factors_long` / `rope_factors_short`, the long ones taken where the context exceeds the original.

Nothing is allocated before the header is checked: the architecture, the tokenizer kind, every tensor's
type and every tensor's shape against the sizes the header declares. Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
Q4_K, Q5_K and Q6_K matrices then stay in their blocks: each weight carries the file's bytes
(DeferredTensor.raw, runtime.quant.gguf_raw.GGUFRaw), which the model lays straight into its kernels' tiles
where it can; else load() parses them (runtime.quant.gguf_blocks.GGUFBlocks) a chunk of rows at a time with
each chunk's pages of the mapped file released (_parse_released), and the model decides whether to run them
packed; every other type is de-quantized by gguf-py one tensor at a time, when the model takes it.
"""

from __future__ import annotations

import math
from collections import Counter
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
from runtime.model.ggml_types import file_type_name
from runtime.model.gguf_metadata import read_gguf_header
from runtime.model.gguf_tensors import read_gguf_tensors
from runtime.model.gguf_tokenizer import tokenizer_source
from runtime.model.rope_scaling import longrope_attention_factor
from runtime.model_config import ModelConfig
from runtime.progress import Progress
from runtime.quant.gguf_blocks import TYPES, GGUFBlocks
from runtime.quant.gguf_raw import GGUFRaw, release_pages

PACKED_TYPES = TYPES
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

GGUF_RMS_NORM_EPS = 1e-5
"""RMSNorm epsilon when the GGUF header does not say (llama.cpp's default)."""
GEMMA3_LOCAL_ROPE_THETA = 10000.0
"""Gemma 3's sliding layers' RoPE base, which llama.cpp's converter does not write (llama.cpp's value)."""
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
"""Every n-th layer attends globally, the others slide (llama.cpp's default per family)."""
WIDE_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Gemma 27B (this many layers) scales queries by (hidden / heads) ** -0.5 instead of head_dim ** -0.5,
as llama.cpp decides (its query_pre_attn_scalar is not in the file)."""

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "post_attention_norm": "attn_output_norm.weight",
    "post_ffw_norm": "mlp_output_norm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def read_gguf(path: Path, name: str, *, with_tokenizer: bool = True) -> Checkpoint:
    """with_tokenizer=False: weights only (TokenizerSource left empty), for a caller that feeds token ids."""
    # the architecture and the vocabulary, checked from the header alone before any weight is read
    try:
        header, table_at = read_gguf_header(path)
    except Exception as exc:  # not a GGUF file, truncated, ...
        raise ValueError(f"model: cannot read {str(path)!r} as GGUF: {exc}") from exc
    if header.get("general.architecture") not in ARCHITECTURES:
        raise ValueError(
            f"model: unsupported architecture {header.get('general.architecture')!r} in {str(path)!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    source = tokenizer_source(header, str(path)) if with_tokenizer else TokenizerSource()
    try:
        table = read_gguf_tensors(path, (header, table_at))
    except Exception as exc:  # not a GGUF file, truncated, ...
        raise ValueError(f"model: cannot read {str(path)!r} as GGUF: {exc}") from exc
    where = str(path)

    def meta(key: str, default=None):
        return header.get(key, default)

    arch = meta("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model: unsupported architecture {arch!r} in {where!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in table}
    config = _config(arch, meta, tensors, name, where)
    check_config(config, where)

    # every tensor named, typed and shaped as the header says, before anything is read
    weights: dict[str, DeferredTensor] = {}
    file_names: dict[str, str] = {}
    for tname, tensor in tensors.items():
        kind = tensor.tensor_type.name
        if kind not in PACKED_TYPES and not _dequantizable(tensor.tensor_type):
            raise ValueError(f"model: {where}: tensor {tname!r} has type {kind}, which is not supported")
        if tname in _ROPE_TENSORS:
            continue
        for canonical, deferred in _weights(arch, tname, tensor, config):
            weights[canonical] = deferred
            file_names[canonical] = tname
    check_shapes({n: w.shape for n, w in weights.items()}, config, where, file_names)
    expected = expected_shapes(config)
    extra = sorted(file_names[n] for n in weights if n not in expected)
    if extra:
        raise ValueError(f"model: {where}: tensors {extra} are not used by a {arch} model (unsupported)")
    progress = Progress(f"loading {name}", total=len(weights))
    for deferred in weights.values():
        deferred.load = _counted(deferred.load, progress)
        if deferred.raw is not None:
            deferred.raw.taken = _counted(lambda: None, progress)
    return Checkpoint(config, {n: w for n, w in weights.items() if n in expected}, source)


def _counted(load, progress: Progress):
    def counted():
        out = load()
        progress.update()
        if progress.done >= progress.total:
            progress.close()
        return out

    return counted


def _dequantizable(qtype) -> bool:
    """A plain float type, or one gguf-py de-quantizes (BF16, the legacy and K-quants, ...)."""
    if qtype.name in _FLOATS:
        return True
    from gguf import quants

    return qtype in getattr(quants, "_type_traits", {})


_FLOATS = ("F32", "F16")
"""Read as float32 here; every other type that is not packed goes through gguf-py's de-quantizer."""


def _config(arch: str, meta, tensors: dict, name: str, where: str) -> ModelConfig:
    def key(suffix: str, default=None):
        return meta(f"{arch}.{suffix}", default)

    def required(suffix: str) -> int:
        value = key(suffix)
        if value is None:
            raise ValueError(f"model: {where}: the header has no {arch}.{suffix}")
        return int(value)

    hidden = required("embedding_length")
    heads = required("attention.head_count")
    kv_heads = int(key("attention.head_count_kv", heads))
    layers = required("block_count")
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // max(heads, 1))))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(
            f"model: {where}: partial rotary embeddings ({arch}.rope.dimension_count {rotary} of head_dim "
            f"{head_dim}) are not supported"
        )
    context = int(key("context_length", DEFAULT_CONTEXT_LENGTH))
    tokens = meta("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else 0))
    features: dict = {}
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        features["rope_linear_factor"] = float(key("rope.scaling.factor", 1.0))
    elif scaling not in (None, "none"):
        raise ValueError(
            f"model: {where}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported"
        )
    if "rope_freqs.weight" in tensors:
        features["rope_freq_factors"] = _factors(tensors["rope_freqs.weight"], head_dim, where)
    if "rope_factors_long.weight" in tensors:  # Phi-3 LongRoPE
        original = int(key("rope.scaling.original_context_length", context))
        chosen = "long" if context > original else "short"
        features["rope_freq_factors"] = _factors(tensors[f"rope_factors_{chosen}.weight"], head_dim, where)
        features["rope_attention_factor"] = float(
            key("rope.scaling.attn_factor", longrope_attention_factor(context, original))
        )
    window = key("attention.sliding_window")
    if window is not None:
        features["sliding_window"] = int(window)
        pattern = key("attention.sliding_window_pattern", SLIDING_PATTERN.get(arch))
        if isinstance(pattern, list):
            features["sliding_layers"] = tuple(bool(p) for p in pattern)
        elif pattern:
            features["sliding_layers"] = tuple(i % int(pattern) < int(pattern) - 1 for i in range(layers))
    if "blk.0.attn_q.bias" in tensors:
        features["qkv_bias"] = True
    if "blk.0.attn_q_norm.weight" in tensors:
        features["qk_norm"] = True
    if arch in ("gemma2", "gemma3"):
        wide = layers == WIDE_SCALE_LAYERS[arch]
        features |= dict(
            sandwich_norms=True,
            hidden_act="gelu_tanh",
            embed_scale=math.sqrt(hidden),
            attention_scale=(hidden / heads if wide else head_dim) ** -0.5,
        )
        for feature in ("attn_logit_softcap", "final_logit_softcap"):
            value = key(feature + "ping")  # gemma2.attn_logit_softcapping, ...
            if value is not None:
                features[feature] = float(value)
    if arch == "gemma3":
        features["rope_theta_local"] = float(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", DEFAULT_ROPE_THETA)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", GGUF_RMS_NORM_EPS)),
        max_model_len=context,
        tie_word_embeddings="output.weight" not in tensors,
        architecture=arch,
        quantization=_quantization(meta, tensors),
        **features,
    )


def _quantization(meta, tensors: dict) -> str:
    """The file's quantization as llama.cpp names it (general.file_type: 'Q4_K_M', 'Q4_1', 'F16'), else
    the type most of the matrices' bytes are in."""
    try:
        return file_type_name(int(meta("general.file_type")))
    except (TypeError, ValueError):
        sizes = Counter()
        for t in tensors.values():
            if len(t.shape) == 2:
                sizes[t.tensor_type.name] += int(t.n_bytes)
        return sizes.most_common(1)[0][0] if sizes else "none"


def _factors(tensor, head_dim: int, where: str) -> tuple[float, ...]:
    values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if values.shape[0] != head_dim // 2:
        raise ValueError(
            f"model: {where}: tensor {tensor.name!r} has {values.shape[0]} values; head_dim {head_dim} "
            f"implies {head_dim // 2}"
        )
    return tuple(float(v) for v in values)


def _weights(arch: str, tname: str, tensor, config: ModelConfig):
    """(canonical name, DeferredTensor) pairs for one GGUF tensor (fused ones give several)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims innermost first
    if tname in _GLOBAL_NAMES:
        yield _GLOBAL_NAMES[tname], _deferred(tensor, shape)
        return
    parts = tname.split(".")
    prefix = f"model.layers.{parts[1]}." if len(parts) == 4 and parts[0] == "blk" else None
    if prefix is None:
        yield tname, DeferredTensor(shape, lambda: None)  # not a layer tensor: reported as unused
        return
    part, suffix = parts[2], parts[3]
    c = config
    if arch == "phi3" and part == "attn_qkv":  # fused: q, k, v row ranges
        bounds = [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        for proj, lo, hi in zip(("q_proj", "k_proj", "v_proj"), bounds, bounds[1:]):
            yield f"{prefix}self_attn.{proj}.{suffix}", _deferred(tensor, shape, rows=(lo, hi))
        return
    if arch == "phi3" and part == "ffn_up":  # gate first, then up
        half = shape[0] // 2
        yield f"{prefix}mlp.gate_proj.{suffix}", _deferred(tensor, shape, rows=(0, half))
        yield f"{prefix}mlp.up_proj.{suffix}", _deferred(tensor, shape, rows=(half, shape[0]))
        return
    if part not in _LAYER_NAMES:
        yield f"{prefix}{part}.{suffix}", DeferredTensor(shape, lambda: None)
        return
    hf = _LAYER_NAMES[part]
    canonical = f"{prefix}{hf}" if hf.endswith(".weight") else f"{prefix}{hf}.{suffix}"
    heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(part) if arch == "llama" else None
    yield canonical, _deferred(tensor, shape, unpermute=heads)


def _deferred(tensor, shape: tuple[int, ...], rows=None, unpermute: int | None = None) -> DeferredTensor:
    """The tensor (or its rows [lo, hi)) read when taken: packed blocks, else de-quantized float32."""
    out_shape = shape if rows is None else (rows[1] - rows[0], *shape[1:])

    def load():
        kind = tensor.tensor_type.name
        if kind in PACKED_TYPES and len(shape) == 2:
            w = _parse_released(kind, tensor.data, shape)
            if rows is not None:
                w = w.take_rows(np.arange(*rows))
        else:
            w = _float32(tensor)
            w = w.reshape(shape)
            w = np.array(w if rows is None else w[rows[0] : rows[1]])  # a writable copy
            release_pages(tensor.data)  # copied: the file's pages (a norm's can map 2 MiB) may go
        return _unpermute(w, unpermute) if unpermute and len(shape) >= 1 else w

    raw = None
    if tensor.tensor_type.name in PACKED_TYPES and len(shape) == 2:
        raw = GGUFRaw(tensor.tensor_type.name, tensor.data.reshape(shape[0], -1).view(np.uint8), shape)
        if rows is not None:
            raw = raw.take_rows(np.arange(*rows))
        if unpermute:
            raw = raw.take_rows(_unpermuted_order(out_shape[0], unpermute))
    return DeferredTensor(out_shape, load, raw)


def _float32(tensor) -> np.ndarray:
    """A tensor that is not packed, as float32 (the file's bytes where they are float32 already)."""
    if tensor.tensor_type.name in _FLOATS:
        return np.asarray(tensor.data, dtype=np.float32)
    from gguf import quants

    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


PARSE_CHUNK_BYTES = 8 << 20
"""A matrix's bytes are parsed this many at a time, each chunk's pages of the mapped file released after."""


def _parse_released(kind: str, data: np.ndarray, shape: tuple[int, int]) -> GGUFBlocks:
    """GGUFBlocks.parse in chunks of rows, dropping each chunk's pages of the memory-mapped file from this
    process once parsed (they stay in the page cache): the file's pages and the parsed copy are never both
    resident for more than a chunk, which keeps a load's peak near the model's own size."""
    n, k = shape
    data = data.reshape(n, -1)
    step = max(1, PARSE_CHUNK_BYTES // max(1, data.shape[1]))
    if n <= step:
        out = GGUFBlocks.parse(kind, data, shape)
        release_pages(data)
        return out
    parts = []
    for lo in range(0, n, step):
        chunk = data[lo : lo + step]
        parts.append(GGUFBlocks.parse(kind, chunk, (chunk.shape[0], k)))
        release_pages(chunk)
    first = parts[0]

    def gather(field: str):
        if getattr(first, field) is None:
            return None
        out = np.empty((n, *getattr(first, field).shape[1:]), getattr(first, field).dtype)
        lo = 0
        for p in parts:
            a = getattr(p, field)
            out[lo : lo + a.shape[0]] = a
            lo += a.shape[0]
            setattr(p, field, None)  # each part freed as it is copied
        return out

    fields = ("codes", "scale", "minimum", "super_scale", "super_minimum")
    return GGUFBlocks(kind, *(gather(f) for f in fields))


def _unpermute(w: np.ndarray | GGUFBlocks, n_head: int) -> np.ndarray | GGUFBlocks:
    """Undo llama.cpp's interleaved-RoPE row order: rows (head, pair, 2) -> (head, 2, pair)."""
    order = _unpermuted_order(w.shape[0], n_head)
    return w.take_rows(order) if isinstance(w, GGUFBlocks) else np.ascontiguousarray(w[order])


def _unpermuted_order(out_dim: int, n_head: int) -> np.ndarray:
    """The file's row of each row in Hugging Face's order (_unpermute)."""
    return np.arange(out_dim).reshape(n_head, out_dim // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
