"""KV block bookkeeping: reference counts, an LRU free queue and automatic prefix caching.

Pure integers; the runtime owns the memory a block id points at. A full block
is identified by a hash chaining its parent block's hash and its token ids, so
equal prefixes map to equal blocks and a block is only ever shared whole.

A block whose last user finished keeps its contents and its hash while it
waits in the free queue: a later request with the same prefix revives it. A
fresh allocation takes the block at the front of the free queue and forgets
its hash (eviction). Blocks without reusable contents go to the front, so they
are taken first; cached blocks go to the back, so the least recently used
cached block is the one evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from functools import lru_cache
from typing import Protocol

from scheduler.request import Request

_ROOT = 0x5EED  # stands in for the parent hash of a request's first block


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Content id of a full block: 128 bits of BLAKE2b over (parent id, token ids).

    Blocks are shared across tenants, so the id must not be forgeable: with Python's
    hash of a tuple of ints, a client could craft a prompt whose blocks collide with
    another tenant's cached prefix and be served that tenant's KV."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((_ROOT if parent is None else parent).to_bytes(16, "little"))
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


@lru_cache(maxsize=4096)
def salt_root(salt: str) -> int:
    """The parent id of a request's first block within a prefix-cache namespace (see Request.cache_salt)."""
    return int.from_bytes(
        hashlib.blake2b(
            salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"prescient-salt"
        ).digest(),
        "little",
    )


class CacheWatcher(Protocol):
    def cached(self, block_hash: int) -> None: ...
    def evicted(self, block_hash: int) -> None: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        """Tokens per block."""
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        """Block tables holding each block."""
        self.num_shared_refs = 0
        """Sum over blocks of max(ref count - 1, 0): extra tables pointing at an already held block."""
        # Unreferenced blocks in eviction order: the front is taken first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._hash: list[int | None] = [None] * num_blocks  # block id -> its hash while cached
        self.copies: list[tuple[int, int]] = []
        """(source, destination) block copies owed to the KV pool before the next step runs: a shared
        partial block copied on write (see fork). The scheduler hands them to the runner."""
        self.rewritten: dict[str, list[int]] = {}
        """request id -> indices of its block table replaced by a private copy since the last plan."""
        self.watcher: CacheWatcher | None = None
        """Told of every hash that enters or leaves the prefix cache (see PrefixIndex)."""

    # ---- counts ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (including cached ones waiting to be revived or evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose contents are registered in the prefix cache (held or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------------

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def prefix_hashes(self, request: Request) -> list[int]:
        """The hashes of the full blocks find_cached_prefix may match (all but the last token's block)."""
        n = (request.num_tokens - 1) // self.block_size
        if n:
            self._hash_of(request, n - 1)
        return request.block_hashes[:n]

    def _hash_of(self, request: Request, index: int) -> int:
        """Hash of the request's full block `index`, computing (once) any missing ones before it."""
        hashes = request.block_hashes
        if index >= len(hashes):
            tokens = request.all_token_ids
            bs = self.block_size
            salt = request.cache_salt if request.cache_salt is not None else request.tenant
            for i in range(len(hashes), index + 1):
                parent = hashes[i - 1] if i else salt_root(salt)
                hashes.append(block_hash(parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes[index]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens, whole blocks only.

        At least the last token is left out, because the engine needs its logits:
        when the whole token stream is cached, the last block is recomputed.
        Hashes are computed lazily up to the first miss.
        """
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block = self._cached.get(self._hash_of(request, i))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, request: Request, num_computed_before: int = 0) -> None:
        """Register the blocks that became full and computed since num_computed_before tokens.

        Passing the count from before the step keeps this O(new blocks) per step.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = request.block_table
        for i in range(num_computed_before // bs, request.num_computed_tokens // bs):
            block = table[i]
            if self._hash[block] is not None:
                continue  # shared from the cache, or registered earlier
            h = self._hash_of(request, i)
            if h not in self._cached:  # else an equal block computed concurrently is already cached
                self._cached[h] = block
                self._hash[block] = h
                if self.watcher is not None:
                    self.watcher.cached(h)

    # ---- allocation -----------------------------------------------------------------------------

    def num_blocks_to_allocate(self, request: Request, num_tokens: int, cached_blocks: list[int] = ()) -> int:
        """Free-queue blocks that covering `num_tokens` tokens would take (fresh ones plus revived cached ones)."""
        have = len(request.block_table) + len(cached_blocks)
        fresh = max(self.blocks_needed(num_tokens) - have, 0)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return fresh + revived

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow request.block_table to cover num_computed_tokens + num_new_tokens tokens.

        Returns False, changing nothing, if the free queue is short. cached_blocks
        (from find_cached_prefix, for a request with an empty table) are attached first.
        """
        table = request.block_table
        fresh = (
            self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table) - len(cached_blocks)
        )
        ref_counts = self.ref_counts
        write = request.num_computed_tokens // self.block_size  # the block the next token goes into
        if write < len(table) and ref_counts[table[write]] > 1 and not cached_blocks:
            return self._copy_on_write(request, write, max(fresh, 0))
        if not cached_blocks and fresh <= 0:
            return True  # the common decode step: the last block still has room
        revived = sum(1 for b in cached_blocks if ref_counts[b] == 0)
        if max(fresh, 0) + revived > len(self._free):
            return False
        for block in cached_blocks:
            if ref_counts[block] == 0:
                del self._free[block]
            else:
                self.num_shared_refs += 1
            ref_counts[block] += 1
            table.append(block)
        for _ in range(fresh):
            table.append(self._take_free())
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give child the parent's blocks by reference (n samples of one prompt computed once).
        The partial last block stays shared until one of them writes into it (copy on write)."""
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        for block in child.block_table:
            self.ref_counts[block] += 1
            self.num_shared_refs += 1

    def _copy_on_write(self, request: Request, index: int, fresh: int) -> bool:
        """Replace the shared block `index` of request's table with a private copy, then add `fresh` blocks."""
        if 1 + fresh > len(self._free):
            return False
        table = request.block_table
        shared = table[index]
        block = self._take_free()
        self.ref_counts[shared] -= 1
        self.num_shared_refs -= 1
        table[index] = block
        self.copies.append((shared, block))
        self.rewritten.setdefault(request.request_id, []).append(index)
        for _ in range(fresh):
            table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:  # evict: its contents are about to be overwritten
            del self._cached[h]
            self._hash[block] = None
            if self.watcher is not None:
                self.watcher.evicted(h)
        self.ref_counts[block] = 1
        return block

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks of request's table past those num_tokens tokens need (they held only the
        K/V of rejected proposals, so they go to the front of the free queue, unhashed)."""
        table = request.block_table
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            block = table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)
            else:
                self.num_shared_refs -= 1

    def free(self, request: Request) -> None:
        """Release the request's blocks. Its tail is freed first, so it is evicted before its shared head."""
        free = self._free
        ref_counts = self.ref_counts
        for block in reversed(request.block_table):
            ref_counts[block] -= 1
            if ref_counts[block] == 0:
                free[block] = None
                if self._hash[block] is None:
                    free.move_to_end(block, last=False)  # nothing to reuse: hand it out first
            else:
                self.num_shared_refs -= 1
        request.block_table = []

    def check_invariants(self, tables: list[list[int]]) -> None:
        """For tests: ref counts equal table membership, the free queue holds exactly the
        unreferenced blocks, and the cache map and the per-block hashes agree."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table:
                counts[block] += 1
        assert counts == self.ref_counts, "ref counts disagree with block tables"
        assert set(self._free) == {b for b in range(self.num_blocks) if counts[b] == 0}, "free queue is wrong"
        assert self.num_shared_refs == sum(max(c - 1, 0) for c in counts), "shared reference count is wrong"
        assert len(self._cached) == sum(h is not None for h in self._hash), (
            "cache map and block hashes disagree"
        )
        for h, block in self._cached.items():
            assert self._hash[block] == h, "cache map and block hashes disagree"
