"""Configuration resolution: the `quantization` setting checked, 'auto' resolved for a dtype and device,
and a projection weight made packed or dense as the resolved setting says."""

from __future__ import annotations

import torch

from runtime.quant.gguf_blocks import GROUP, GGUFBlocks
from runtime.quant.linear import Int4Linear, pack_gguf, quantize_int4, quantize_int8
from runtime.quant.quantizations import QUANTIZATIONS
from runtime.quant.routing import packed_measures_faster


def check_quantization(quantization: str | None, device: torch.device) -> str:
    q = quantization or "auto"
    if q not in QUANTIZATIONS:
        raise ValueError(
            f"quantization: {quantization!r} is not supported; choose one of {list(QUANTIZATIONS)}"
        )
    if q not in ("auto", "none") and device.type != "cpu":
        raise ValueError(
            f"quantization: {q!r} runs on CPU only (torch's weight-only kernels); "
            f"use 'none' or 'auto' on {device.type}"
        )
    return q


def resolve_quantization(
    quantization: str | None, dtype: torch.dtype, device: torch.device, dtype_chosen: bool = False
) -> str:
    """'auto' keeps a GGUF's blocks packed on CPU where the packed kernels are fast: bfloat16 activations,
    or a float32 that dtype 'auto' chose (`dtype_chosen`: the CPU computes bfloat16 slowly, as on AVX2) where
    packed_measures_faster; a float32 the user named stays dense (exact). It dequantizes elsewhere; any
    other choice stands."""
    q = check_quantization(quantization, device)
    if q == "auto":
        if device.type != "cpu":
            return "none"
        if dtype == torch.bfloat16 or (dtype == torch.float32 and dtype_chosen and packed_measures_faster()):
            return "gguf"
        return "none"
    return q


def make_linear(
    source, quantization: str, dtype: torch.dtype, device: torch.device, dense: bool = False
) -> torch.Tensor | Int4Linear:
    """A projection weight [N, K] from a numpy array or GGUFBlocks, packed or dense as `quantization` says
    (already resolved: 'gguf' keeps blocks, 'none' dequantizes, 'int8' / 'int4' re-quantize);
    `dense`: packed GGUF blocks also keep a dequantized copy (see runtime.quant.linear)."""
    if (
        isinstance(source, GGUFBlocks)
        and quantization == "gguf"
        and source.shape[1] % GROUP == 0
        and source.fits_float16()
    ):
        return pack_gguf(source, dtype, dense)
    dense = torch.from_numpy(source.dequantize() if isinstance(source, GGUFBlocks) else source)
    if quantization == "int8":
        return quantize_int8(dense, dtype)
    if quantization == "int4" and dense.shape[1] % GROUP == 0:
        return quantize_int4(dense, dtype)
    return dense.to(device=device, dtype=dtype)
