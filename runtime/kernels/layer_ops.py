"""The element-wise work of a layer in C (csrc/layer_ops.c): residual add + RMSNorm, SiLU- or GELU-and-multiply,
QKV bias + per-head q/k RMSNorm + RoPE + the KV cache write, each one call instead of several torch ops, for
any number of rows.

At a few rows a torch op costs more in dispatch than in arithmetic (a layer of
the PyTorch path is ~40 of them); at many rows one vectorized pass over the
data, shared out over torch's thread count, beats several. They compute the
PyTorch path's function, rounding to the model dtype where it does (the tests
compare both).
"""

from __future__ import annotations

import torch

from runtime.kernels.library import load


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load() is not None


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    """h [T, D] += delta (in place; None: no add), then out = rms_norm(h) * weight. All in h's dtype."""
    delta = None if delta is None else delta.contiguous()
    load().add_rms_norm(
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        h.shape[0],
        h.shape[1],
        eps,
        _bf16(h),
        torch.get_num_threads(),
    )


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [T, 2I] (gate, then up) -> out [T, I] = silu(gate) * up."""
    gate_up = gate_up.contiguous()
    load().silu_mul(
        gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], _bf16(out), torch.get_num_threads()
    )


def gelu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [T, 2I] (gate, then up) -> out [T, I] = gelu_tanh(gate) * up (GELU's tanh approximation)."""
    gate_up = gate_up.contiguous()
    load().gelu_mul(
        gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], _bf16(out), torch.get_num_threads()
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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
    """qkv [T, (H + 2 KVH) D] (+ bias [(H + 2 KVH) D] where given) -> rotated queries into q_out [T, H, D]
    (float32 or qkv's dtype), rotated keys and the values into their slots of the caches [blocks,
    block_size, KVH, D]. q_norm, k_norm [D] (both or neither): each query and key head RMS-normalised with
    them before the rotation. cos, sin_signed: RotaryEmbedding's tables."""
    qkv = qkv.contiguous()
    t, heads, d = q_out.shape
    load().rope_write_kv(
        qkv.data_ptr(),
        _ptr(bias),
        _ptr(q_norm),
        _ptr(k_norm),
        eps,
        positions.data_ptr(),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        q_out.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        t,
        heads,
        k_cache.shape[2],
        d,
        _bf16(qkv),
        int(q_out.dtype == torch.float32),
        torch.get_num_threads(),
    )
