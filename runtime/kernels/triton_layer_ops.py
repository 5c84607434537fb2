"""The element-wise work of a layer on CUDA in Triton: residual add + RMSNorm, SiLU-and-multiply, RoPE + the
KV cache write, each one kernel for all rows. The same three calls, with the same arguments and rounding,
as native_layer_ops (C, on CPU), so LlamaModel runs one layer loop over either.

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


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """qkv [T, (H + 2 KVH) D] -> rotated queries into q_out [T, H, D], rotated keys and the values into their
    slots of the caches [blocks, block_size, KVH, D] (contiguous). cos, sin_signed: RotaryEmbedding's tables."""
    qkv = qkv.contiguous()
    t, heads, d = q_out.shape
    kv_heads = k_cache.shape[2]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q_out.is_contiguous()
    _rope_write_kv[(t,)](
        qkv,
        positions,
        cos,
        sin_signed,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        H=heads,
        KVH=kv_heads,
        D=d,
        QK_P=triton.next_power_of_2(heads + kv_heads),
        V_P=triton.next_power_of_2(kv_heads),
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
    def _rope_write_kv(
        qkv_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        H: tl.constexpr,
        KVH: tl.constexpr,
        D: tl.constexpr,
        QK_P: tl.constexpr,
        V_P: tl.constexpr,
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
        tl.store(
            v_ptr + slot * KVH * D + vh[:, None] * D + d[None, :],
            v.to(v_ptr.dtype.element_ty),
            mask=is_v[:, None],
        )
