"""The decode step's element-wise work in C (runtime.kernels.layer_ops) against the PyTorch path's ops, and
the engine's decode with it against the engine without it. Each kernel test runs at every level this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import SamplingParams
from runtime.attention.kv_cache import write_kv
from runtime.kernels import layer_ops as native_layer_ops
from runtime.kernels import library as native_kernels
from runtime.model.model import RotaryEmbedding, rms_norm
from runtime.model.rope_scaling import inverse_frequencies
from tests.runtime.conftest import CHATS, chat_ids
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    native_kernels.load() is None, reason="the native kernels cannot be built here"
)
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to rounding: float32 to 1e-5 of the largest value (sums in another order), bfloat16 to one unit
    in the last place of each value (one rounding where the PyTorch path has two)."""
    diff, size = (got.float() - expected.float()).abs(), expected.float().abs()
    if dtype == torch.float32:
        assert diff.max() <= 1e-5 * size.max()
    else:
        assert (diff <= 2**-7 * size + 1e-6).all()


ROWS = [3, 130]  # a decode step's few rows; a prefill's many (shared out over threads), 130: not a multiple


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("kernel_level")
def test_add_rms_norm_is_the_residual_add_then_rms_norm(dtype, rows):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, 576, generator=g) * 4).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype)
    expected_h = h + delta
    expected = rms_norm(expected_h, weight, 1e-5)
    out = torch.empty_like(h)
    native_layer_ops.add_rms_norm(h, delta, weight, out, 1e-5)
    assert torch.equal(h, expected_h)
    _close(out, expected, dtype)
    native_layer_ops.add_rms_norm(h, None, weight, out, 1e-5)  # no add: h stays
    assert torch.equal(h, expected_h)
    _close(out, expected, dtype)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("kernel_level")
def test_silu_mul_is_silu_of_gate_times_up(dtype, rows):
    gate_up = (torch.randn(rows, 2 * 1540, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])  # exp's clamps: silu -> 0, x
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty(rows, 1540, dtype=dtype)
    native_layer_ops.silu_mul(gate_up, out)
    _close(out, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("kernel_level")
def test_gelu_mul_is_tanh_gelu_of_gate_times_up(dtype, rows):
    gate_up = (torch.randn(rows, 2 * 1540, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -30.0, 90.0, 0.0])  # exp's clamps: gelu -> 0, x
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty(rows, 1540, dtype=dtype)
    native_layer_ops.gelu_mul(gate_up, out)
    expected = F.gelu(gate, approximate="tanh") * up
    if dtype == torch.float32:
        _close(out, expected, dtype)
    else:  # where 1 + tanh(u) cancels (gate < ~-4) float32 keeps few bits of it: |values| < 1e-4 there
        assert ((out.float() - expected.float()).abs() <= 2**-7 * expected.float().abs() + 1e-4).all()


@pytest.mark.parametrize("d", [64, 24])  # 24: halves narrower than the vector width, the scalar loop
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("kernel_level")
def test_rope_write_kv_rotates_q_and_k_and_fills_the_slots(dtype, rows, d):
    heads, kv_heads, t = 9, 3, rows
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.randperm(512, generator=g)[:t]
    slots = torch.randperm(4 * 16 if t <= 64 else 16 * 16, generator=g)[:t]
    rope = RotaryEmbedding(inverse_frequencies(d, 10000.0), 512, dtype, torch.device("cpu"))
    cos, sin = rope.tables(positions)
    qk = rope.rotate(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin, rope.half)
    k_expected, v_expected = (
        torch.zeros(16, 16, kv_heads, d, dtype=dtype),
        torch.zeros(16, 16, kv_heads, d, dtype=dtype),
    )
    write_kv(
        k_expected, v_expected, qk[:, heads:], qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d), slots
    )
    q = torch.empty(t, heads, d)
    k_cache, v_cache = torch.zeros_like(k_expected), torch.zeros_like(v_expected)
    native_layer_ops.rope_write_kv(qkv, positions, rope.cos, rope.sin_signed, q, k_cache, v_cache, slots)
    _close(q, qk[:, :heads], dtype)
    _close(k_cache, k_expected, dtype)
    assert torch.equal(v_cache, v_expected)
    q_model = torch.empty(t, heads, d, dtype=dtype)  # queries in the model dtype, as prefill attention takes
    native_layer_ops.rope_write_kv(
        qkv, positions, rope.cos, rope.sin_signed, q_model, k_cache, v_cache, slots
    )
    _close(q_model, qk[:, :heads], dtype)


def test_engine_decodes_the_same_tokens_with_and_without_it(engine_fp32):
    """float32: the C path computes the PyTorch path's function to rounding, so greedy tokens agree."""
    model = engine_fp32.model
    assert model.native_decode
    prompts = [chat_ids(engine_fp32.tokenizer, c) for c in CHATS[:3]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    native = [o.token_ids for o in engine_fp32.generate(prompts, params)]
    model.native_decode = False
    try:
        plain = [o.token_ids for o in engine_fp32.generate(prompts, params)]
    finally:
        model.native_decode = True
    assert native == plain


@pytest.mark.parametrize("d", [256, 24])  # Gemma's head_dim; the scalar loop
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("kernel_level")
def test_rope_write_kv_adds_the_bias_and_normalises_q_and_k_per_head(dtype, rows, d):
    """Qwen 2's QKV bias and Qwen 3 / Gemma 3's per-head q/k RMSNorm before RoPE, as the PyTorch path
    computes them (model.forward): each alone and both together."""
    heads, kv_heads, t, eps = 4, 2, rows, 1e-6
    g = torch.Generator().manual_seed(4)
    width = (heads + 2 * kv_heads) * d
    qkv = (torch.randn(t, width, generator=g) * 3).to(dtype)
    bias = torch.randn(width, generator=g).to(dtype)
    q_norm, k_norm = (
        (torch.rand(d, generator=g) + 0.5).to(dtype),
        (torch.rand(d, generator=g) + 0.5).to(dtype),
    )
    positions = torch.randperm(512, generator=g)[:t]
    slots = torch.randperm(16 * 16, generator=g)[:t]
    rope = RotaryEmbedding(inverse_frequencies(d, 1e6), 512, dtype, torch.device("cpu"))
    cos, sin = rope.tables(positions)
    for with_bias, with_norm in [(True, False), (False, True), (True, True)]:
        x = qkv + bias if with_bias else qkv
        q = x[:, : heads * d].view(t, heads, d)
        k = x[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
        if with_norm:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = rope.rotate(q, cos, sin, rope.half), rope.rotate(k, cos, sin, rope.half)
        k_expected = torch.zeros(16, 16, kv_heads, d, dtype=dtype)
        v_expected = torch.zeros_like(k_expected)
        write_kv(k_expected, v_expected, k, x[:, (heads + kv_heads) * d :].view(t, kv_heads, d), slots)
        q_out = torch.empty(t, heads, d)
        k_cache, v_cache = torch.zeros_like(k_expected), torch.zeros_like(v_expected)
        native_layer_ops.rope_write_kv(
            qkv,
            positions,
            rope.cos,
            rope.sin_signed,
            q_out,
            k_cache,
            v_cache,
            slots,
            bias=bias if with_bias else None,
            q_norm=q_norm if with_norm else None,
            k_norm=k_norm if with_norm else None,
            eps=eps,
        )
        _close_per_head(q_out, q, dtype)
        _close_per_head(k_cache, k_expected, dtype)
        assert torch.equal(v_cache, v_expected)


def _close_per_head(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """bfloat16: the norm's sum runs in another order, so a value may round one unit the other way before
    RoPE, which can cancel: within a unit in the last place of the head's largest value."""
    if dtype == torch.float32:
        return _close(got, expected, dtype)
    diff = (got.float() - expected.float()).abs()
    assert (diff <= 2**-7 * expected.float().abs().amax(-1, keepdim=True) + 1e-6).all()
