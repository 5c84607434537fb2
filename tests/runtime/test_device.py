"""dtype='auto' on CPU: the dtype that measured fastest, never one the CPU emulates (timings injected)."""

from __future__ import annotations

import torch

from runtime import device


def test_pick_fastest_takes_the_smallest_time_among_native_dtypes():
    native = [torch.float32, torch.bfloat16]
    assert device.pick_fastest({torch.float32: 2.0, torch.bfloat16: 1.0}, native) == torch.bfloat16
    assert device.pick_fastest({torch.float32: 1.0, torch.bfloat16: 2.0}, native) == torch.float32
    assert device.pick_fastest({torch.float32: 1.0, torch.bfloat16: 1.0}, native) == torch.float32


def test_an_emulated_dtype_is_never_picked_even_when_measured_fastest():
    native = device.native_cpu_dtypes({"avx2", "fma"})
    assert native == [torch.float32]
    assert device.pick_fastest({torch.float32: 5.0, torch.bfloat16: 0.1}, native) == torch.float32


def test_measured_once_per_cpu_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("PRESCIENT_CACHE", str(tmp_path))
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    calls = []

    def measure(dtype):
        calls.append(dtype)
        return {torch.float32: 3.0, torch.bfloat16: 1.0}[dtype]

    assert device.fastest_cpu_dtype.__wrapped__(measure) == torch.bfloat16
    assert set(calls) == {torch.float32, torch.bfloat16}
    calls.clear()
    assert device.fastest_cpu_dtype.__wrapped__(measure) == torch.bfloat16 and not calls  # from the cache

    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512f", "avx2"})  # another CPU: bf16 emulated
    assert device.fastest_cpu_dtype.__wrapped__(measure) == torch.float32
