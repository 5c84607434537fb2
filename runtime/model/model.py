"""The decoder (GQA, RoPE, RMSNorm, gated MLP, optionally tied head) over a paged KV cache.

One definition serves Llama, Mistral, Qwen 2/3, Gemma 2/3 and Phi-3: what differs is data in
ModelConfig (biases, q/k norms, sandwich norms, GELU, embedding scale, sliding windows, soft-caps, RoPE
scalings). Tokens of all sequences in a step arrive flattened: input_ids [T], positions [T];
AttentionMetadata says which rows decode and which are prefill chunks. Q/K/V and gate/up projections are
fused into one matmul each. Projection weights are dense tensors or packed quantized ones
(runtime.quant.linear). On CPU every family's layers run their element-wise work in the fused C layer ops
(_forward_native) and decode-only steps in one C call (decode_layers); on CUDA in the Triton twins;
elsewhere the PyTorch layer loop (forward) computes the same function. Attention is the backend the
metadata names (runtime/attention/backend.py), given each layer's sliding window and soft-cap.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from runtime.attention.kv_cache import KVCache, write_kv
from runtime.attention.metadata import AttentionMetadata
from runtime.kernels import layer_ops as native_layer_ops
from runtime.kernels import quantized_matmul as native_matmul
from runtime.kernels import triton_layer_ops
from runtime.model.checkpoint_types import DeferredTensor
from runtime.model.decode_layers import NativeDecode, in_parts
from runtime.model.rope_scaling import inverse_frequencies
from runtime.model_config import ModelConfig
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.gguf_raw import dequantize_raw, libc, pack_raw, relayable
from runtime.quant.linear import (
    BlockEmbedding,
    Int4Linear,
    linear,
    pack_native,
    pack_stacked,
    weight_nbytes,
)
from runtime.quant.resolve import make_linear
from runtime.quant.routing import measure_dense_rows, measure_row_paths


def _return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing): packing a
    weight frees temporaries into the heap, and a large model's load would otherwise keep them resident
    until its end (tests/bench/gguf_load_memory.py)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the model dtype (as the reference implementation does)."""
    if x.dtype == torch.float32:  # F.rms_norm computes the same float32 function in fewer ops
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    """Half-split RoPE: cos/sin tables in float32 for every position, cast to the model dtype.

    rotate_half(x) * sin is computed as roll(x, D/2) * sin_signed, sin_signed = [-sin, sin] by halves (a
    negation moves no rounding), so a step's rotation is a few whole-tensor ops over q and k together.
    inv_freq: the (scaled) inverse frequencies, rope_scaling.inverse_frequencies; attention_factor
    multiplies cos and sin (LongRoPE).

    On CPU the tables start at INITIAL_POSITIONS rows and grow (doubling, up to max_len) as `cover` is asked
    for later positions, so that, like the KV cache, they take memory for the context in use: a model's
    whole context is tens of MB a table. Elsewhere they are made whole at once (CUDA graphs keep their
    addresses)."""

    INITIAL_POSITIONS = 1024
    CHUNK = 4096
    """Rows computed at a time: no table-sized float32 temporaries."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_factor: float = 1.0,
    ):
        self.inv_freq, self.max_len, self.dtype, self.device = inv_freq, max_len, dtype, device
        self.attention_factor = attention_factor
        self.half = inv_freq.shape[0]
        self.grows = device.type == "cpu"
        self.length = 0
        """Positions the tables hold."""
        self.cover(self.INITIAL_POSITIONS if self.grows else max_len)

    def cover(self, positions: int) -> bool:
        """Make the tables hold positions 0 .. positions - 1 (at most max_len); True when they were remade
        (their addresses changed)."""
        if positions <= self.length or self.length == self.max_len:
            return False
        length = min(self.max_len, max(positions, 2 * self.length))
        cos = torch.empty(length, 2 * self.half, dtype=self.dtype)
        sin_signed = torch.empty_like(cos)
        for lo in range(0, length, self.CHUNK):
            rows = torch.arange(lo, min(length, lo + self.CHUNK), dtype=torch.int64).float()
            freqs = torch.outer(rows, self.inv_freq)
            c = (freqs.cos() * self.attention_factor).to(self.dtype)
            s = (freqs.sin() * self.attention_factor).to(self.dtype)
            cos[lo : lo + len(rows)] = torch.cat((c, c), dim=-1)
            sin_signed[lo : lo + len(rows)] = torch.cat((-s, s), dim=-1)
        self.cos, self.sin_signed = cos.to(self.device), sin_signed.to(self.device)
        self.length = length
        return True

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) rows of these positions, [T, 1, D]: gathered once a step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, half: int) -> torch.Tensor:
        """x [T, heads, D] rotated: x * cos + rotate_half(x) * sin."""
        return torch.addcmul(x * cos, x.roll(half, dims=-1), sin_signed)


class Layer:
    def __init__(self, config: ModelConfig, norm, proj):
        """norm(suffixes) -> one dense tensor (concatenated); proj(suffixes) -> one (fused) projection
        weight. Tensor names are Hugging Face Llama's, with the other families' extras under names of their
        own (checkpoint_types.LAYER_TENSORS)."""
        self.input_norm = norm(["input_layernorm.weight"])
        self.post_norm = norm(["post_attention_layernorm.weight"])
        """The MLP's input norm (Llama's name for it; Gemma's pre_feedforward_layernorm)."""
        self.qkv = proj(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"])
        self.o = proj(["self_attn.o_proj.weight"])
        self.gate_up = proj(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
        self.down = proj(["mlp.down_proj.weight"])
        self.qkv_bias = (
            norm(["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"])
            if config.qkv_bias
            else None
        )
        self.q_norm = norm(["self_attn.q_norm.weight"]) if config.qk_norm else None
        self.k_norm = norm(["self_attn.k_norm.weight"]) if config.qk_norm else None
        self.attn_out_norm = norm(["attn_output_norm.weight"]) if config.sandwich_norms else None
        self.mlp_out_norm = norm(["mlp_output_norm.weight"]) if config.sandwich_norms else None


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, np.ndarray | GGUFBlocks | DeferredTensor],
        dtype: torch.dtype,
        device: torch.device,
        quantization: str = "none",
        dense_copy_bytes: int | None = None,
    ):
        """quantization: as resolved by runtime.quant.resolve.resolve_quantization ('none', 'gguf', 'int8',
        'int4'); dense_copy_bytes: the memory for packed projections' dense copies (ModelSettings)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        self.dense_rows: int | None = None
        """Packed projections run as dense matmuls from this many rows up (None: always packed)."""
        self.native_rows: dict[tuple[int, int, bool], int | None] = {}
        """(out, in features, C kernels only: Int4Linear.native_only) of packed projections -> the C kernel
        serves up to this many rows (None: never), as measured at load."""
        self.gemm_rows: dict[tuple[int, int, bool], int | None] = {}
        """(out, in features, C kernels only) -> the C kernel's many-row loops serve from this many rows up
        (None: never)."""

        reused = {"model.embed_tokens.weight"}  # the embedding and a tied LM head: read once for both
        shared: dict[str, np.ndarray | GGUFBlocks] = {}

        def source(name: str) -> np.ndarray | GGUFBlocks:
            if name not in weights:
                raise ValueError(f"model: checkpoint is missing the weight {name!r}")
            w = weights[name]
            if not isinstance(w, DeferredTensor):
                return w
            if name not in shared:
                shared[name] = w.load()  # read now, one tensor at a time
            return shared.pop(name) if name not in reused else shared[name]

        def file_floats(names: list[str]) -> np.ndarray | None:
            """float32 straight from the file's bytes (runtime.quant.gguf_raw.dequantize_raw), where every part
            has them and none is held for a second use; else None."""
            raws = [getattr(weights.get(n), "raw", None) for n in names]
            if any(r is None or n in shared for n, r in zip(names, raws)):
                return None
            w = dequantize_raw(raws)
            if w is not None:
                for n in names:
                    weights[n].raw.taken()
            return w

        def tensor(name: str) -> torch.Tensor:
            w = file_floats([name])
            if w is None:
                w = source(name)
                w = w.dequantize() if isinstance(w, GGUFBlocks) else w
            return torch.from_numpy(w).to(device=device, dtype=dtype)

        def dense(names: list[str]) -> torch.Tensor:
            return torch.cat([tensor(n) for n in names]) if len(names) > 1 else tensor(names[0])

        dense_budget = [dense_copy_bytes]  # bytes left for dense copies (None: no cap)

        def from_file(names: list[str], how: str):
            """The weights laid from the file's bytes straight into the C kernels' tiles (runtime.quant.gguf_raw),
            where each has a path there and no dense copy is asked for; else None."""
            raws = [getattr(weights.get(n), "raw", None) for n in names]
            if (
                how != "gguf"
                or dense_budget[0] is not None
                or device.type != "cpu"
                or any(r is None or n in shared for n, r in zip(names, raws))
                or not relayable(raws, dtype)
            ):
                return None
            w = pack_raw(raws, dtype)
            if w is not None:
                for n in names:
                    weights[n].raw.taken()
            return w

        def proj(names: list[str], how: str = quantization):
            from_raw = from_file(names, how)
            if from_raw is not None:
                return from_raw
            floats = file_floats(names) if how != "gguf" else None
            if floats is not None:  # a dense weight, or one quantized again from floats
                w = make_linear(floats, how, dtype, device)
                del floats
                _return_freed_memory()
                return w
            parts = [source(n) for n in names]
            # parts of different kinds (a K-quant mix), each in its own kind's tiles, where no dense copy is asked
            stacked = (
                pack_stacked(parts, dtype, device) if how == "gguf" and dense_budget[0] is None else None
            )
            if stacked is not None:
                del parts
                _return_freed_memory()
                return stacked
            fused = GGUFBlocks.stack(parts) if all(isinstance(p, GGUFBlocks) for p in parts) else None
            if fused is None:
                fused = np.concatenate([p.dequantize() if isinstance(p, GGUFBlocks) else p for p in parts])
            # no dense copies unless asked for where the C kernels' many-row loops are built
            dense = how == "gguf" and (dense_budget[0] is not None or not native_matmul.vector_loops())
            if dense and dense_budget[0] is not None:
                cost = fused.shape[0] * fused.shape[1] * dtype.itemsize
                dense = cost <= dense_budget[0]
                dense_budget[0] -= cost if dense else 0
            w = make_linear(fused, how, dtype, device, dense=dense)
            del fused, parts
            _return_freed_memory()
            return w

        # the layers first: their dense copies serve every prefill row, the LM head's only sampled rows
        self.layers = [
            Layer(
                config,
                lambda names, i=i: dense([f"model.layers.{i}.{s}" for s in names]),
                lambda names, i=i: proj([f"model.layers.{i}.{s}" for s in names]),
            )
            for i in range(config.num_layers)
        ]

        # a tied table laid from the file's bytes into the LM head's tiles (no parsed copy: a load's peak),
        # its lookups dequantizing rows of those tiles; else parsed below
        tied = None
        if config.tie_word_embeddings and native_matmul.usable(config.hidden_size, dtype, device):
            tied = from_file(["model.embed_tokens.weight"], quantization)
        # dense ("none"): the table comes from the file's bytes in tensor() below, never parsed
        embed = None if quantization == "none" or tied is not None else source("model.embed_tokens.weight")
        _return_freed_memory()  # the parse's chunks: a large table's blocks are made a chunk at a time
        if tied is not None:
            self.lm_head = tied
            self.embed = BlockEmbedding(self.lm_head.native, dtype)
        elif (
            quantization == "gguf"
            and config.tie_word_embeddings
            and isinstance(embed, GGUFBlocks)
            and (embed.kind != "Q6_K" or embed.shape[0] % (2 * native_matmul.TILE_COLUMNS) == 0)
            and embed.fits_float16()
            and native_matmul.usable(config.hidden_size, dtype, device)
        ):
            # one copy of the table's blocks: the tied LM head multiplies by it, lookups dequantize its rows
            shared.pop("model.embed_tokens.weight", None)
            self.lm_head = pack_native(embed, dtype, consume=True)
            del embed
            self.embed = BlockEmbedding(self.lm_head.native, dtype)
        elif quantization != "none" and (config.tie_word_embeddings or isinstance(embed, GGUFBlocks)):
            # looked up row by row: only the rows a step reads are dequantized
            self.embed = (
                BlockEmbedding(embed, dtype)
                if isinstance(embed, GGUFBlocks)
                else tensor("model.embed_tokens.weight")
            )
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            self.lm_head = proj([head], "int8" if quantization == "int4" else quantization)
        else:
            self.embed = tensor("model.embed_tokens.weight")
            self.lm_head = self.embed if config.tie_word_embeddings else proj(["lm_head.weight"])
        self.norm = tensor("model.norm.weight")
        shared.clear()
        _return_freed_memory()
        self._choose_dense_rows()
        self._choose_native_rows()
        c = config
        inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_freq_factors, c.rope_linear_factor)
        self.rope = RotaryEmbedding(inv_freq, c.max_model_len, dtype, device, c.rope_attention_factor)
        self.local_rope = self.rope
        """The sliding layers' RoPE (Gemma 3: its own base, unscaled)."""
        if c.rope_theta_local is not None:
            local = inverse_frequencies(c.head_dim, c.rope_theta_local)
            self.local_rope = RotaryEmbedding(local, c.max_model_len, dtype, device)
        self.windows = [c.layer_window(i) for i in range(c.num_layers)]
        """Each layer's sliding window (None: full causal attention)."""
        self.embed_scale = torch.tensor(c.embed_scale, dtype=dtype) if c.embed_scale != 1.0 else None
        self.layer_ops = None
        """The layers' element-wise work fused, every family's: native_layer_ops (C, CPU) or
        triton_layer_ops (CUDA)."""
        if native_layer_ops.usable(dtype, device) and config.head_dim % 2 == 0:
            self.layer_ops = native_layer_ops
        elif triton_layer_ops.usable(dtype, device) and config.head_dim & (config.head_dim - 1) == 0:
            self.layer_ops = triton_layer_ops
        self.native_decode = self.layer_ops is not None
        """Every step runs the layers' element-wise work in layer_ops (on CPU, steps that only decode their
        attention in C too); False: the PyTorch ops."""
        self.scale = config.attention_scale or config.head_dim**-0.5
        self._native_decode: tuple[KVCache, NativeDecode | None] | None = None
        """The KV cache the C layer loop was made for, and that loop (_decode_layers)."""

    def prepare(self, positions: int, kv: KVCache) -> None:
        """Make what the steps share before several threads run parts of one (decode_layers.run_parts): the
        RoPE tables through these positions and the C layer loop, so that no part grows or remakes them."""
        if self.rope.grows:
            self._cover(positions)
        if self.native_decode:
            self._decode_layers(kv)

    def _cover(self, positions: int) -> None:
        """Grow the RoPE tables to these positions; the C layer loop, which holds their addresses, is made
        again where they moved."""
        grown = [r.cover(positions) for r in {id(r): r for r in (self.rope, self.local_rope)}.values()]
        if any(grown):
            self._native_decode = None

    def layer_rope(self, i: int) -> RotaryEmbedding:
        """Layer i's RoPE: the sliding layers' own where the model has one (Gemma 3's local base)."""
        return self.local_rope if self.windows[i] is not None else self.rope

    def _packed(self) -> list[Int4Linear]:
        ws = [self.lm_head] + [
            w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        return [w for w in ws if isinstance(w, Int4Linear)]

    def _choose_dense_rows(self) -> None:
        """Packed projections with a dense copy use it from the row count where it measured faster on the
        first layer's gate/up projection; where it never did, the copies are dropped."""
        packed = [w for w in self._packed() if w.dense is not None]
        if not packed:
            return
        probe = self.layers[0].gate_up
        probe = probe if probe in packed else packed[0]  # the first layer's copy may be over the cap
        rows = measure_dense_rows(probe)
        for w in packed:
            w.dense_rows = rows
            if rows is None:
                w.dense = None
        self.dense_rows = rows

    def _choose_native_rows(self) -> None:
        """Packed projections with a copy for the C kernel route rows by measure_row_paths (once per shape):
        its one-row loops up to the rows where they were the fastest path, its many-row loops from the rows
        where those were, the dense copy or torch's packed kernel in between; a copy (the tiled one, the
        dense one, the kernel's own) that no row count uses is dropped."""
        for w in self._packed():
            if w.native is None:
                continue
            shape = (w.out_features, w.in_features, w.packed is None)
            if shape not in self.native_rows:
                self.native_rows[shape], self.gemm_rows[shape] = measure_row_paths(w)
            w.native_rows, w.gemm_rows = self.native_rows[shape], self.gemm_rows[shape]
            if w.packed is None:  # the C kernels' one layout (Int4Linear.native_only): nothing to drop
                continue
            if w.gemm_rows is None:
                w.native.tiles = None
            elif w.dense_rows is None or w.gemm_rows <= w.dense_rows:
                w.dense, w.dense_rows = None, None  # the many-row loops win wherever the copy would
            if w.native_rows is None and w.gemm_rows is None:
                w.native = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads (the embedding's few rows aside)."""
        tensors = [self.norm, self.lm_head]
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down]
        return sum(weight_nbytes(t) for t in tensors)

    @property
    def layer_parameters(self) -> int:
        """Projection parameters every token multiplies by (2 FLOP each), the LM head aside."""
        c = self.config
        per_layer = (
            c.hidden_size * (c.q_size + 2 * c.kv_size)
            + c.q_size * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
        )
        return c.num_layers * per_layer

    @property
    def lm_head_parameters(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (normalised), one row per input token."""
        if self.rope.grows and positions.numel():
            self._cover(int(positions.max()) + 1)
        if self.native_decode:
            return self._forward_native(input_ids, positions, meta, kv)
        c = self.config
        t = input_ids.shape[0]
        eps = c.rms_norm_eps
        rope_tables = {id(r): (r, *r.tables(positions)) for r in (self.rope, self.local_rope)}
        h = self.embed[input_ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        for i, layer in enumerate(self.layers):
            window = self.windows[i]
            x = rms_norm(h, layer.input_norm, eps)
            qkv = linear(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
            k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
            rope, cos, sin = rope_tables[id(self.local_rope if window is not None else self.rope)]
            if layer.q_norm is None:  # q and k heads side by side: one rotation for both
                qk = rope.rotate(qkv[:, : c.q_size + c.kv_size].view(t, -1, c.head_dim), cos, sin, rope.half)
                q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            else:
                q, k = rope.rotate(q, cos, sin, rope.half), rope.rotate(k, cos, sin, rope.half)
            k_cache, v_cache = kv.layer(i)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = meta.backend.forward(
                q, k, v, k_cache, v_cache, meta, self.scale, window, c.attn_logit_softcap
            )
            o = linear(attn.reshape(t, c.q_size), layer.o)
            if layer.attn_out_norm is not None:
                o = rms_norm(o, layer.attn_out_norm, eps)
            h = h + o
            x = rms_norm(h, layer.post_norm, eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if c.hidden_act == "gelu_tanh" else F.silu(gate)
            m = linear(act.mul_(up), layer.down)
            if layer.mlp_out_norm is not None:
                m = rms_norm(m, layer.mlp_out_norm, eps)
            h = h + m
        return rms_norm(h, self.norm, eps)

    def _forward_native(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """forward with each layer's element-wise work fused (layer_ops: C on CPU, Triton on CUDA): a few
        calls per layer instead of ~40 torch ops, every family's features included (QKV bias and q/k norms in
        rope_write_kv, GELU in gelu_mul, sandwich norms as add_rms_norm without an add). On CPU, steps that
        only decode take the C attention kernel straight from float32 queries; every step attends through the
        metadata's backend with each layer's window and soft-cap."""
        c, ops = self.config, self.layer_ops
        t, eps = input_ids.shape[0], c.rms_norm_eps
        decode_only = not meta.prefills and meta.num_decode == t and meta.backend.native
        h = self.embed[input_ids].contiguous()
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if decode_only and (layers := self._decode_layers(kv)) is not None and layers.usable(t):
            return layers.forward(h, positions.contiguous(), meta)
        x = torch.empty_like(h)
        q_dtype = torch.float32 if decode_only else self.dtype
        q = torch.empty(t, c.num_heads, c.head_dim, dtype=q_dtype, device=self.device)
        act = torch.empty(t, c.intermediate_size, dtype=self.dtype, device=self.device)
        branch = torch.empty_like(h) if c.sandwich_norms else None
        gelu = c.hidden_act == "gelu_tanh"
        positions = positions.contiguous()
        ops.add_rms_norm(h, None, self.layers[0].input_norm, x, eps)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)
            rope, window = self.layer_rope(i), self.windows[i]
            extras = {}
            if layer.qkv_bias is not None or layer.q_norm is not None:
                extras = dict(bias=layer.qkv_bias, q_norm=layer.q_norm, k_norm=layer.k_norm, eps=eps)
            ops.rope_write_kv(
                linear(x, layer.qkv),
                positions,
                rope.cos,
                rope.sin_signed,
                q,
                k_cache,
                v_cache,
                meta.slot_mapping,
                **extras,
            )
            # the new keys and values are read back from the cache
            attn = meta.backend.forward(
                q, None, None, k_cache, v_cache, meta, self.scale, window, c.attn_logit_softcap
            ).view(t, c.q_size)
            o = self._project(attn, layer.o) if decode_only else linear(attn, layer.o)
            if layer.attn_out_norm is not None:
                ops.add_rms_norm(o.contiguous(), None, layer.attn_out_norm, branch, eps)
                o = branch
            ops.add_rms_norm(h, o, layer.post_norm, x, eps)
            gate_up = layer.gate_up
            if gelu:
                ops.gelu_mul(linear(x, gate_up), act)
            elif not (isinstance(gate_up, Int4Linear) and gate_up.silu_mul_into(x, act)):
                ops.silu_mul(linear(x, gate_up), act)
            m = linear(act, layer.down)
            if layer.mlp_out_norm is not None:
                ops.add_rms_norm(m.contiguous(), None, layer.mlp_out_norm, branch, eps)
                m = branch
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            ops.add_rms_norm(h, m, following, x, eps)
        return x

    def _decode_layers(self, kv: KVCache) -> NativeDecode | None:
        """The C loop over the layers for decode-only steps on this cache (None where it cannot run)."""
        if self._native_decode is None or self._native_decode[0] is not kv:
            self._native_decode = (kv, NativeDecode(self, kv) if NativeDecode.possible(self, kv) else None)
        return self._native_decode[1]

    def _project(self, x: torch.Tensor, w: torch.Tensor | Int4Linear) -> torch.Tensor:
        """x W^T for float32 x, out in the model dtype: the C matmul takes float32 as it is."""
        if isinstance(w, Int4Linear):
            return w(x, out_dtype=self.dtype)
        return linear(x.to(self.dtype), w)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (soft-capped where the model caps them)."""
        logits = in_parts(lambda rows: linear(rows, self.lm_head).float(), hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)
