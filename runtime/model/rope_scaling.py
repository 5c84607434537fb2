"""RoPE frequencies: the base inverse frequencies and the scalings real checkpoints use, as data.

Every scaling the supported families use reduces to per-frequency divisors (ModelConfig.rope_freq_factors)
plus a cos/sin multiplier (rope_attention_factor) and a linear position factor (rope_linear_factor):
llama3 (Llama 3.1+) and LongRoPE (Phi-3) both divide each frequency by a factor; a GGUF stores those
divisors as tensors (rope_freqs, rope_factors_long / _short), a config.json as rules computed here.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(
    head_dim: int, theta: float, freq_factors: tuple[float, ...] | None = None, linear_factor: float = 1.0
) -> torch.Tensor:
    """float32 [head_dim / 2]: theta ** (-2i / head_dim), divided by each frequency's factor and by the
    linear factor."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        if len(freq_factors) != head_dim // 2:
            raise ValueError(
                f"model: {len(freq_factors)} RoPE frequency factors for head_dim {head_dim} "
                f"(expected {head_dim // 2})"
            )
        inv = inv / torch.tensor(freq_factors, dtype=torch.float32)
    return inv / linear_factor if linear_factor != 1.0 else inv


def llama3_freq_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> tuple[float, ...]:
    """Llama 3.1's rule as divisors: wavelengths longer than original_context / low_freq_factor are
    stretched by `factor`, shorter than original_context / high_freq_factor kept, and those between
    blended linearly in original_context / wavelength."""
    inv = inverse_frequencies(head_dim, theta).double()
    wavelength = 2 * math.pi / inv
    low_wavelength = original_context / low_freq_factor
    high_wavelength = original_context / high_freq_factor
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelength > low_wavelength, inv / factor, inv)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    scaled = torch.where(medium, blended, scaled)
    return tuple((inv / scaled).tolist())


def longrope_attention_factor(context: int, original_context: int) -> float:
    """LongRoPE's cos/sin multiplier for a context stretched from original_context (1 where not)."""
    scale = context / original_context
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original_context))
