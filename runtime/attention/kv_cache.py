"""The paged KV pool: one preallocated tensor of fixed-size blocks per layer.

Which block belongs to which sequence is the scheduler's bookkeeping
(scheduler.BlockManager); this file only owns the memory. A token's K and V
live at flat slot `block_id * block_size + offset`.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

from runtime.model_config import ModelConfig

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's (still untouched) memory with 2 MiB pages where transparent huge pages
    are on "madvise". A sequence's KV blocks lie anywhere in the pool, so decode attention jumps between
    pages at every block: with 4 KiB pages each jump is a TLB miss. Returns whether the advice was taken."""
    if not sys.platform.startswith("linux") or tensor.nbytes < 2 * HUGE_PAGE:
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of block_size tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on fresh anonymous pages: zero by the kernel's guarantee, and a page costs nothing until a
    block on it is first written (a large pool of which a server uses a corner starts at once, not after
    writing every byte). Page-aligned, so the huge-page advice covers all of it but its ends."""
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * element
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=math.prod(shape)).view(shape)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch: bool = False,
    ):
        """scratch: one block more than num_blocks, never handed out (the scheduler knows num_blocks):
        rows that pad a batch to a captured CUDA graph's size write their K/V there (scratch_slot)."""
        if num_blocks < 1:
            raise ValueError(
                "kv_cache_bytes: too small to hold even one KV block "
                f"({bytes_per_block(config, block_size, dtype)} bytes)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size if scratch else None
        # [layer, k/v, block, offset in block, kv head, head dim]
        shape = (config.num_layers, 2, num_blocks + scratch, block_size, config.num_kv_heads, config.head_dim)
        device = torch.device(device)
        if device.type == "cpu":
            self.pool = zeroed_cpu_tensor(shape, dtype)
            advise_huge_pages(self.pool)
        else:
            self.pool = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.pool[index, 0], self.pool[index, 1]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): [(source, destination), ...]."""
        src = torch.tensor([a for a, _ in copies], device=self.pool.device)
        dst = torch.tensor([b for _, b in copies], device=self.pool.device)
        self.pool[:, :, dst] = self.pool[:, :, src]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim] into their slots of one layer's pool."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_positions(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` positions of one layer's pool [blocks, block_size, kv_heads, D], through
    its block table, as [length, kv_heads, D]."""
    return cache.index_select(0, block_table).flatten(0, 1)[:length]
