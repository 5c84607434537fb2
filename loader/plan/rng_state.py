"""A worker's RNG states (torch, random, numpy) as one fixed-layout uint8 tensor, never a pickle.

The state travels from a worker to shared memory, into `state_dict()`, through a user's
checkpoint and back into a worker of a new process. A checkpoint may come from anywhere,
so decoding it must never run code: the layout is plain numbers, checked field by field in
the main process before any worker gets them, as torch.set_rng_state, random.setstate and
numpy's set_state check them (and where numpy does not: its position indexes the key array,
so a position past 624 reads out of bounds in the worker).

Layout (little-endian), RNG_STATE_BYTES in all:
  torch   uint8[TORCH_BYTES]   torch.get_rng_state() (the CPU Mersenne Twister and its normal cache)
  random  int64[627]           version, 624 state words and the position, has_gauss; then float64 gauss
  numpy   uint32[624]          MT19937 key; then int64 pos, int64 has_gauss, float64 cached_gaussian
"""

from __future__ import annotations

import random

import numpy as np
import torch

TORCH_BYTES = int(torch.get_rng_state().numel())
_PY_WORDS = 627  # version, 625 words of random.getstate()[1], has_gauss
_SECTIONS = [
    ("torch", np.uint8, TORCH_BYTES),
    ("py", "<i8", _PY_WORDS),
    ("py_gauss", "<f8", 1),
    ("np_key", "<u4", 624),
    ("np_pos", "<i8", 2),
    ("np_gauss", "<f8", 1),
]
RNG_STATE_BYTES = sum(np.dtype(dtype).itemsize * count for _, dtype, count in _SECTIONS)


def _split(buffer: np.ndarray) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    for name, dtype, count in _SECTIONS:
        size = np.dtype(dtype).itemsize * count
        out[name] = buffer[offset : offset + size].view(dtype)
        offset += size
    return out


def capture_rng() -> torch.Tensor:
    """This process's torch, random and numpy RNG states as a uint8 tensor of RNG_STATE_BYTES."""
    buffer = np.zeros(RNG_STATE_BYTES, dtype=np.uint8)
    parts = _split(buffer)
    parts["torch"][:] = torch.get_rng_state().numpy()
    version, words, gauss = random.getstate()
    parts["py"][0], parts["py"][1:626], parts["py"][626] = version, words, gauss is not None
    parts["py_gauss"][0] = gauss or 0.0
    kind, key, pos, has_gauss, cached = np.random.get_state()
    parts["np_key"][:] = key
    parts["np_pos"][:] = (pos, has_gauss)
    parts["np_gauss"][0] = cached
    return torch.from_numpy(buffer)


def restore_rng(state: torch.Tensor) -> None:
    """Set torch, random and numpy from what capture_rng() returned (checked by check_rng)."""
    parts = _split(check_rng(state, "worker_rng").numpy())
    torch.set_rng_state(torch.from_numpy(parts["torch"].copy()))
    py = parts["py"].tolist()
    random.setstate((py[0], tuple(py[1:626]), float(parts["py_gauss"][0]) if py[626] else None))
    pos, has_gauss = parts["np_pos"].tolist()
    np.random.set_state(("MT19937", parts["np_key"].copy(), pos, has_gauss, float(parts["np_gauss"][0])))


MT_WORDS = 624  # Mersenne Twister state words (torch, random and numpy all use MT19937)


def check_torch_state(state, field: str) -> torch.Tensor:
    """`state` if torch.Generator.set_state accepts it (size and Mersenne Twister fields, checked on
    a throwaway generator); ValueError naming `field` if not."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError(f"load_state_dict: {field} must be a uint8 RNG state tensor, got {_what(state)}")
    if state.numel() != TORCH_BYTES:
        raise ValueError(
            f"load_state_dict: {field} must hold {TORCH_BYTES} bytes (a CPU generator's state), got "
            f"{state.numel()}; pass what DataLoader.state_dict() returned"
        )
    try:
        torch.Generator().set_state(state.contiguous())
    except RuntimeError as error:
        raise ValueError(f"load_state_dict: {field} is not a valid torch RNG state ({error})") from None
    return state.contiguous()


def check_rng(state, field: str) -> torch.Tensor:
    """`state` if it is a worker RNG state whose every field torch, random and numpy accept;
    ValueError naming `field` and the part at fault if not."""
    if (
        not isinstance(state, torch.Tensor)
        or state.dtype != torch.uint8
        or state.dim() != 1
        or state.numel() != RNG_STATE_BYTES
    ):
        raise ValueError(
            f"load_state_dict: {field} must hold uint8 tensors of {RNG_STATE_BYTES} bytes, got "
            f"{_what(state)}; pass what DataLoader.state_dict() returned"
        )
    state = state.contiguous()
    parts = _split(state.numpy())
    check_torch_state(torch.from_numpy(parts["torch"].copy()), f"{field}.torch")
    py = parts["py"]
    _expect(py[0] == 3, field, "random.version", int(py[0]), "3 (random.getstate()'s version)")
    words = py[1:625]
    _expect(bool(((words >= 0) & (words < 1 << 32)).all()), field, "random.key", "a word", "in [0, 2**32)")
    _expect(0 <= py[625] <= MT_WORDS, field, "random.pos", int(py[625]), f"in [0, {MT_WORDS}]")
    _expect(py[626] in (0, 1), field, "random.has_gauss", int(py[626]), "0 or 1")
    pos, has_gauss = (int(v) for v in parts["np_pos"])
    _expect(0 <= pos <= MT_WORDS, field, "numpy.pos", pos, f"in [0, {MT_WORDS}]")
    _expect(has_gauss in (0, 1), field, "numpy.has_gauss", has_gauss, "0 or 1")
    for name, value in (
        ("random.gauss", parts["py_gauss"][0]),
        ("numpy.cached_gaussian", parts["np_gauss"][0]),
    ):
        _expect(bool(np.isfinite(value)), field, name, float(value), "a finite float")
    return state


def _expect(ok: bool, field: str, part: str, got, rule: str) -> None:
    if not ok:
        raise ValueError(
            f"load_state_dict: {field}.{part} must be {rule}, got {got!r}; the checkpoint is damaged or "
            "was not written by DataLoader.state_dict()"
        )


def _what(state) -> str:
    if isinstance(state, torch.Tensor):
        return f"{state.dtype} tensor of shape {tuple(state.shape)}"
    return type(state).__name__
