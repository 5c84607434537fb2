"""What one step's attention knows of its rows, whichever backend computes it.

A step's tokens are flattened into one batch: first one row for each decoding sequence, then each prefill
chunk's rows. The runner describes each scheduled sequence as a ScheduledRows; the chosen backend
(backend.py) turns those into its own AttentionMetadata subclass with what its kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ScheduledRows:
    """One sequence's rows this step: its positions start .. end - 1 (a decode: one)."""

    block_table: list[int]  # its blocks, covering at least end positions
    start: int  # tokens already in the cache before this step
    end: int  # tokens in the cache after it


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    end: int  # one past its last row
    context_len: int  # tokens in the cache after this chunk (cached prefix + chunk)
    block_table: torch.Tensor | None  # [blocks covering context_len] (None: the backend's rows carry tables)


@dataclass
class AttentionMetadata:
    """Rows [0, num_decode) decode one token each; the prefill chunks follow. `backend` built it and is what
    the model calls (AttentionBackend.forward)."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of every new token
    backend: Any  # the AttentionBackend that built it (backend.py imports this file, not the reverse)
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [B] int64: cached tokens each decode attends to
    prefills: list[PrefillChunk] = field(default_factory=list)
