"""How much of each waiting request's prompt the prefix cache holds now, without touching blocks.

A waiting request's full blocks have a hash chain (BlockManager.prefix_hashes);
its cached-prefix match is the number of leading hashes of that chain that
are in the prefix cache. The block manager tells this index of every hash that
enters the cache (a block filled and registered) or leaves it (evicted), and
the index updates exactly the waiting requests whose chain holds that hash:

    cached(h) at depth i: requests whose match stopped at i extend it along their chain
    evicted(h) at depth i: requests whose match went past i are cut back to i

A hash fixes its whole prefix (it chains its parent's), so it sits at one depth
in every chain that holds it. Waiting requests are kept in groups (a tenant, or
one group for all) in a heap by longest match, ties to the earliest arrival;
heap entries of a request whose match changed are left in place and skipped
when they surface (a version stamp), and a heap that grows to twice its live
entries is rebuilt. So longest() is O(log waiting) amortized, and an update
costs O(requests that share the hash x log waiting).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator

from scheduler.block_manager import BlockManager
from scheduler.request import Request


class _Entry:
    __slots__ = ("request", "group", "chain", "match", "version", "seq", "uid")

    def __init__(self, request: Request, group: Hashable, chain: list[int], seq: float, uid: int):
        self.request = request
        self.group = group
        self.chain = chain
        self.match = 0
        self.version = 0
        self.seq = seq
        self.uid = uid


class PrefixIndex:
    def __init__(self) -> None:
        self._bm: BlockManager | None = None
        self._entries: dict[Request, _Entry] = {}
        self._postings: dict[int, set[_Entry]] = {}
        """Block hash -> waiting requests whose chain holds it."""
        self._depth: dict[int, int] = {}
        """Block hash -> its index in any chain that holds it."""
        self._heaps: dict[Hashable, list[tuple[int, float, int, int, _Entry]]] = {}
        """Group -> heap of (-match, seq, uid, version, entry); stale versions are skipped."""
        self._members: dict[Hashable, dict[_Entry, None]] = {}
        """Group -> its waiting requests' entries, in the order added."""
        self._uids = itertools.count()

    def attach(self, block_manager: BlockManager) -> None:
        """Watch this block manager's prefix cache (call before any add)."""
        self._bm = block_manager
        block_manager.watcher = self

    # ---- waiting requests -----------------------------------------------------------------------

    def add(self, request: Request, group: Hashable, seq: float | None = None) -> None:
        """Index a waiting request; seq orders equal matches (default: the order of adds)."""
        bm = self._bm
        chain = bm.prefix_hashes(request) if bm is not None and bm.enable_prefix_caching else []
        uid = next(self._uids)
        entry = _Entry(request, group, chain, uid if seq is None else seq, uid)
        self._entries[request] = entry
        depth, postings = self._depth, self._postings
        for i, h in enumerate(chain):
            depth[h] = i
            posting = postings.get(h)
            if posting is None:
                posting = postings[h] = set()
            posting.add(entry)
        entry.match = self._extend(chain, 0)
        members = self._members.get(group)
        if members is None:
            members = self._members[group] = {}
        members[entry] = None
        self._push(entry)

    def remove(self, request: Request) -> bool:
        entry = self._entries.pop(request, None)
        if entry is None:
            return False
        postings = self._postings
        for h in entry.chain:
            posting = postings[h]
            posting.discard(entry)
            if not posting:
                del postings[h]
                del self._depth[h]
        entry.version = -1  # its heap entries are stale
        group = entry.group
        members = self._members[group]
        del members[entry]
        if not members:
            del self._members[group]
            del self._heaps[group]
        return True

    def match(self, request: Request) -> int:
        """Full blocks of the request's prompt cached now (what find_cached_prefix would return)."""
        return self._entries[request].match

    def longest(self, group: Hashable) -> Request | None:
        """The group's waiting request with the longest match (ties: lowest seq)."""
        entry = self._top(group)
        return entry.request if entry is not None else None

    def longest_match(self, group: Hashable) -> tuple[int, float] | None:
        """(match in blocks, seq) of the group's best request, for comparing groups."""
        entry = self._top(group)
        return (entry.match, entry.seq) if entry is not None else None

    def groups(self) -> Iterator[Hashable]:
        """Groups with a waiting request, in the order they last became non-empty."""
        return iter(self._members)

    def has(self, group: Hashable) -> bool:
        return group in self._members

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: Request) -> bool:
        return request in self._entries

    def requests(self) -> Iterator[Request]:
        return (e.request for e in self._entries.values())

    # ---- cache events (from the block manager) --------------------------------------------------

    def cached(self, block_hash: int) -> None:
        posting = self._postings.get(block_hash)
        if not posting:
            return
        i = self._depth[block_hash]
        for entry in list(posting):
            if entry.match == i:
                entry.match = self._extend(entry.chain, i)
                self._push(entry)

    def evicted(self, block_hash: int) -> None:
        posting = self._postings.get(block_hash)
        if not posting:
            return
        i = self._depth[block_hash]
        for entry in posting:
            if entry.match > i:
                entry.match = i
                self._push(entry)

    # ---- internals ------------------------------------------------------------------------------

    def _extend(self, chain: list[int], start: int) -> int:
        is_cached = self._bm.is_cached if self._bm is not None else None
        n = start
        while n < len(chain) and is_cached(chain[n]):
            n += 1
        return n

    def _push(self, entry: _Entry) -> None:
        entry.version += 1
        heap = self._heaps.get(entry.group)
        if heap is None:
            heap = self._heaps[entry.group] = []
        heapq.heappush(heap, (-entry.match, entry.seq, entry.uid, entry.version, entry))
        members = self._members[entry.group]
        if len(heap) > 2 * len(members) + 16:
            live = [(-e.match, e.seq, e.uid, e.version, e) for e in members]
            heapq.heapify(live)
            self._heaps[entry.group] = live

    def _top(self, group: Hashable) -> _Entry | None:
        heap = self._heaps.get(group)
        while heap:
            _, _, _, version, entry = heap[0]
            if version == entry.version:
                return entry
            heapq.heappop(heap)
        return None
