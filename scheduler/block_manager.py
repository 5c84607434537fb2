"""KV block bookkeeping: reference counts, an LRU free queue and automatic prefix caching.

Pure integers. A full block is identified by a hash chaining its parent's
hash and its token ids, so equal prefixes map to equal blocks. A block whose
last user finished keeps its contents and its hash while it waits in the free
queue: a later request with the same prefix revives it; a new allocation
takes the least recently freed block and forgets its hash (eviction).
"""
from __future__ import annotations

from collections import OrderedDict

from scheduler.request import Request

_NO_PARENT = 0x5EED


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((_NO_PARENT if parent is None else parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # free blocks, least recently freed first (the next to be evicted)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}             # block hash -> block id
        self._key: list[tuple | None] = [None] * num_blocks   # block id -> (hash, parent, tokens)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------------

    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first num_tokens tokens, extending request.block_hashes."""
        hashes = request.block_hashes
        want = num_tokens // self.block_size
        if len(hashes) < want:
            tokens = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), want):
                hashes.append(block_hash(hashes[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes[:want]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least the last token is left to compute, because the engine needs its logits.
        """
        if not self.enable_prefix_caching:
            return []
        num_tokens = request.num_tokens
        hashes = self._full_block_hashes(request, num_tokens - 1)
        blocks = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        hashes = self._full_block_hashes(request, request.num_computed_tokens)
        for i, h in enumerate(hashes):
            block = request.block_table[i]
            if self._key[block] is not None:
                continue  # already registered (shared, or registered in an earlier step)
            if h not in self._cached:
                self._cached[h] = block
                self._key[block] = h

    # ---- allocation -----------------------------------------------------------------------------

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        have = len(request.block_table) + len(cached_blocks)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - have
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return need <= len(self._free) - revived

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow request.block_table to cover num_computed_tokens + num_new_tokens; False if blocks are short.

        cached_blocks (from find_cached_prefix) are attached first, when the table is empty.
        """
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            request.block_table.append(block)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._key[block]
            if key is not None:  # evict: its contents are about to be overwritten
                if self._cached.get(key) == block:
                    del self._cached[key]
                self._key[block] = None
            self.ref_counts[block] = 1
            request.block_table.append(block)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes into the free queue first, so it is evicted first."""
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
        request.block_table = []

    def check_invariants(self, tables: list[list[int]]) -> None:
        """For tests: ref counts equal table membership, and the free queue holds exactly the unreferenced."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table:
                counts[block] += 1
        assert counts == self.ref_counts, "ref counts disagree with block tables"
        assert set(self._free) == {b for b in range(self.num_blocks) if counts[b] == 0}, "free queue is wrong"
        for h, block in self._cached.items():
            assert self._key[block] == h, "cache map and block keys disagree"
