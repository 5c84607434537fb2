"""The element-wise work of a layer on CUDA in Triton: residual add + RMSNorm, SiLU- or GELU-and-multiply, QKV
bias + per-head q/k RMSNorm + RoPE + the KV cache write, each one kernel for all rows. The same calls, with
the same arguments and rounding, as native_layer_ops (C, on CPU), so LlamaModel runs one layer loop over
either, for every family.

On a GPU a small model's layer is a dozen short kernels of a few microseconds each; the PyTorch path
spends ~25 launches a layer on these element-wise steps alone (casts, powers, means, rolls), and in a
CUDA graph the GPU still runs them one after another. Fused, a layer is the four projections, the
attention and these four kernels. They round to the model dtype where the PyTorch path does (x * cos
before adding the rotated half, silu(gate) before multiplying by up, the normalised row before the
weight), so both paths compute the same function.
"""

from __future__ import annotations

import torch

from runtime.kernels.triton_attention import triton

if triton is not None:
    import triton.language as tl


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    """h [T, D] += delta (in place; None: no add), then out = rms_norm(h) * weight. All in h's dtype."""
    t, d = h.shape
    assert h.is_contiguous() and out.is_contiguous()
    delta = h if delta is None else delta.contiguous()
    _add_rms_norm[(t,)](
        h, delta, weight, out, d, eps, HAS_DELTA=delta is not h, BLOCK=triton.next_power_of_2(d)
    )


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [T, 2I] (gate, then up) -> out [T, I] = silu(gate) * up."""
    gate_up = gate_up.contiguous()
    t, inter = out.shape
    block = 1024
    _silu_mul[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)


def gelu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [T, 2I] (gate, then up) -> out [T, I] = gelu_tanh(gate) * up (GELU's tanh approximation)."""
    gate_up = gate_up.contiguous()
    t, inter = out.shape
    block = 1024
    _gelu_mul[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    bias: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """qkv [T, (H + 2 KVH) D] (+ bias where given) -> rotated queries into q_out [T, H, D], rotated keys and the
    values into their slots of the caches [blocks, block_size, KVH, D] (contiguous); q_norm, k_norm [D]: each
    query and key head RMS-normalised before the rotation. cos, sin_signed: RotaryEmbedding's tables."""
    qkv = qkv.contiguous()
    t, heads, d = q_out.shape
    kv_heads = k_cache.shape[2]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q_out.is_contiguous()
    assert (q_norm is None) == (k_norm is None)
    _rope_write_kv[(t,)](
        qkv,
        positions,
        cos,
        sin_signed,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        qkv if bias is None else bias,
        qkv if q_norm is None else q_norm,
        qkv if k_norm is None else k_norm,
        eps,
        H=heads,
        KVH=kv_heads,
        D=d,
        QK_P=triton.next_power_of_2(heads + kv_heads),
        V_P=triton.next_power_of_2(kv_heads),
        HAS_BIAS=bias is not None,
        HAS_NORM=q_norm is not None,
    )


if triton is not None:

    @triton.jit
    def _add_rms_norm(h_ptr, delta_ptr, w_ptr, out_ptr, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * n
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        h = tl.load(h_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            h = h + tl.load(delta_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row + cols, h, mask=mask)
            h = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
        x = (h * r).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + cols, (w * x).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_mul(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        e = tl.exp(tl.minimum(tl.maximum(1.5957691216057308 * (g + 0.044715 * g * g * g), -87.0), 88.0))
        th = 1.0 - 2.0 / (1.0 + e)  # tanh, as the C kernel writes it
        s = (0.5 * g * (1.0 + th)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_write_kv(
        qkv_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        bias_ptr,
        qn_ptr,
        kn_ptr,
        eps,
        H: tl.constexpr,
        KVH: tl.constexpr,
        D: tl.constexpr,
        QK_P: tl.constexpr,
        V_P: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t)
        slot = tl.load(slot_ptr + t)
        heads = tl.arange(0, QK_P)
        d = tl.arange(0, D)
        partner = (d + D // 2) % D  # rotate_half's partner; its sign is in sin_signed
        row = qkv_ptr + t * (H + 2 * KVH) * D
        qk = heads < H + KVH
        x = tl.load(row + heads[:, None] * D + d[None, :], mask=qk[:, None], other=0.0).to(tl.float32)
        xp = tl.load(row + heads[:, None] * D + partner[None, :], mask=qk[:, None], other=0.0).to(tl.float32)
        dt = qkv_ptr.dtype.element_ty
        if HAS_BIAS:  # rounded to the dtype, as the PyTorch path's qkv + bias
            b = tl.load(bias_ptr + heads[:, None] * D + d[None, :], mask=qk[:, None], other=0.0).to(
                tl.float32
            )
            bp = tl.load(bias_ptr + heads[:, None] * D + partner[None, :], mask=qk[:, None], other=0.0)
            x = (x + b).to(dt).to(tl.float32)
            xp = (xp + bp.to(tl.float32)).to(dt).to(tl.float32)
        if HAS_NORM:  # per-head RMSNorm: the partner is in the same head, so the same factor
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
            is_q_row = (heads < H)[:, None]
            w = tl.where(is_q_row, tl.load(qn_ptr + d)[None, :], tl.load(kn_ptr + d)[None, :]).to(tl.float32)
            wp = tl.where(is_q_row, tl.load(qn_ptr + partner)[None, :], tl.load(kn_ptr + partner)[None, :])
            x = (w * (x * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (wp.to(tl.float32) * (xp * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        xc = (x * c[None, :]).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        y = (xc + xp * s[None, :]).to(qkv_ptr.dtype.element_ty)
        is_q = heads < H
        tl.store(
            q_ptr + t * H * D + heads[:, None] * D + d[None, :],
            y.to(q_ptr.dtype.element_ty),
            mask=is_q[:, None],
        )
        is_k = (heads >= H) & qk
        k_dst = k_ptr + slot * KVH * D + (heads - H)[:, None] * D + d[None, :]
        tl.store(k_dst, y.to(k_ptr.dtype.element_ty), mask=is_k[:, None])
        vh = tl.arange(0, V_P)
        is_v = vh < KVH
        v = tl.load(row + (H + KVH) * D + vh[:, None] * D + d[None, :], mask=is_v[:, None], other=0.0)
        if HAS_BIAS:
            vb = tl.load(
                bias_ptr + (H + KVH) * D + vh[:, None] * D + d[None, :], mask=is_v[:, None], other=0.0
            )
            v = (v.to(tl.float32) + vb.to(tl.float32)).to(dt)
        tl.store(
            v_ptr + slot * KVH * D + vh[:, None] * D + d[None, :],
            v.to(v_ptr.dtype.element_ty),
            mask=is_v[:, None],
        )
