"""Temperature and top-p sampling for rows without top-k, in one C call (csrc/nucleus_sampling.c).

The PyTorch path (sampler.py) spends several full passes over a [rows, vocab]
tensor per op: divide, softmax, cumsum, searchsorted, compare-and-sum, and a
masked fill for each rejection round. The kernel does the same top-p rejection
in a few vectorized passes per row, with the row in cache. Each draw is an
exponential race (every token's Exp(1) noise from a hash of its index and a key),
which moves only when two tokens' scores tie to within a change in the logits;
an inverse CDF in index order moves across a run of unlikely tokens whenever the
logits move by float noise. The keys come from one uniform per row, so a seeded
request's tokens still depend only on its own generator. Where the library
cannot be had, sampler.py keeps the PyTorch path.
"""

from __future__ import annotations

import threading

import torch

from runtime.kernels.library import load

_scratch = threading.local()


def usable(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and load() is not None
    )


def nucleus_sample(
    logits: torch.Tensor, temperature: list[float], top_p: list[float], uniforms: torch.Tensor
) -> torch.Tensor:
    """logits [R, V] float32 (rows may be strided, elements contiguous); temperature > 0 and top_p in (0, 1]
    per row; uniforms float64 [R] in [0, 1). Returns R token ids (int64)."""
    rows, vocab = logits.shape
    work = getattr(_scratch, "buffer", None)
    if work is None or work.numel() < rows * vocab:
        work = _scratch.buffer = torch.empty(rows * vocab, dtype=torch.float32)
    temperatures = torch.tensor(temperature, dtype=torch.float32)
    top_ps = torch.tensor(top_p, dtype=torch.float32)
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    load().nucleus_sample(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        temperatures.data_ptr(),
        top_ps.data_ptr(),
        uniforms.data_ptr(),
        work.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 (usable() first): each row's argmax, as torch.argmax(dim=-1) returns it (the
    first of tied maxima, the first NaN where a row holds one), in one vectorized pass per row (torch's
    argmax reads a 262,144-token row at ~1 element a nanosecond). Returns R token ids (int64)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    load().greedy_sample(
        logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out
