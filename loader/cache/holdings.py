"""What this node holds: samples in the shared-memory data area and on the local disk,
which of them placement keeps (Belady, see placement.py), and which are pinned.

A sample is pinned while plan positions that were published to the workers and not yet
consumed refer to it; pinned bytes never move. Bytes in shared memory that placement does
not keep are "staged": read ahead for one use and freed after it (they count against the
prefetch budget, not the cache budget). A sample the RAM tier lets go may be kept on disk.
Under peer exchange some samples are this rank's to keep for the cluster (its "home"
samples, see peer_plan.py): placement ranks every home sample ahead of every other one, so
a rank's copies of other ranks' samples never push out what only it keeps.
Used only by the prefetch coordinator thread.
"""

from __future__ import annotations

import numpy as np

from loader.cache.arena import Arena
from loader.cache.disk import DiskTier, read_file
from loader.cache.ram import ABSENT, DISK, DISK_HITS, FAILED, LENGTH, RAM, RAM_HITS, SharedState
from loader.plan.placement import NEVER, BeladyCache

HOME_FIRST = 1 << 62  # subtracted from a home sample's next use: ahead of any other sample
HORIZON_CAP = 1 << 40  # a home sample not used again by this rank still ranks ahead


class Holdings:
    def __init__(self, shared: SharedState, cache_ram: int, disk: DiskTier | None):
        self.shared, self.disk = shared, disk
        self.ram = BeladyCache(cache_ram)
        self.disk_set = BeladyCache(disk.budget) if disk else None
        self.disk_pending: dict[int, int] = {}
        self.arena = Arena(shared.layout.arena)
        # Per sample, plain ints only (see BeladyCache): the bytes in the shared data area,
        self.held: dict[int, int] = {}  # index -> offset
        self.held_size: dict[int, int] = {}  # index -> bytes
        self.pins: dict[int, int] = {}  # index -> published positions not yet consumed (none: 0)
        self.held_next: dict[int, int] = {}  # index -> next use after the last one published
        self.reserved: dict[int, int] = {}  # index -> offset: kept, bytes to come (a fill)
        self.reserved_size: dict[int, int] = {}
        self.staged_bytes = self.staged_peak = 0  # held bytes outside the RAM cache set
        self.home: np.ndarray | None = None  # bool per sample: kept by this rank for its peers

    def placement_key(self, index: int, upcoming: int) -> int:
        """The next-use key placement compares: home samples rank ahead of all others."""
        if self.home is not None and self.home[index]:
            return min(upcoming, HORIZON_CAP) - HOME_FIRST
        return upcoming

    def has(self, index: int) -> bool:
        return index in self.held or self.on_disk(index)

    def on_disk(self, index: int) -> bool:
        return self.disk_set is not None and index in self.disk_set

    def renumber(self, first: dict[int, int]) -> None:
        """A new epoch's plan: next uses are now positions in it."""

        def key(index: int) -> int:
            return self.placement_key(index, first.get(index, NEVER))

        self.ram.renumber(key)
        if self.disk_set is not None:
            self.disk_set.renumber(key)
        self.held_next = {index: key(index) for index in self.held}

    # --- a planned use -------------------------------------------------------------------------
    def use(self, index: int, upcoming: int) -> int:
        """Pin a held sample for one more use; returns the tier it is read from (or ABSENT)."""
        upcoming = self.placement_key(index, upcoming)
        if index in self.reserved:  # kept when it was last used; a worker's bytes are still on their way
            self.ram.touch(index, upcoming)
            return ABSENT
        if index in self.held:
            self.pins[index] = self.pins.get(index, 0) + 1
            self.held_next[index] = upcoming
            if index in self.ram:
                self.ram.touch(index, upcoming)
            else:
                size = self.held_size[index]
                victims = self.ram.offer(index, size, upcoming)
                if victims is not None:
                    self.staged_bytes -= size
                    self._evict(victims)
            self.shared.counters[0, RAM_HITS] += 1
            return RAM
        if self.on_disk(index):
            self.disk_pending[index] = self.disk_pending.get(index, 0) + 1
            self.disk_set.touch(index, upcoming)
            self.shared.counters[0, DISK_HITS] += 1
            return DISK
        return ABSENT

    def place(self, index: int, raw: bytes | BaseException, upcoming: int, can_wait: bool) -> int | None:
        """Put a fresh read in shared memory, pinned for its use. Returns its tier, or None when
        it must wait for consumption to free room (only if `can_wait`)."""
        upcoming = self.placement_key(index, upcoming)
        if isinstance(raw, BaseException):
            self.shared.set_entry(index, FAILED)  # the worker re-reads and raises with index and path
            return ABSENT
        offset = self.arena.alloc(len(raw))
        while offset is None and not can_wait and self._evict_one():
            offset = self.arena.alloc(len(raw))
        if offset is None:
            if can_wait:
                return None
            self.shared.set_entry(index, ABSENT)  # larger than the whole area: the worker reads it
            return ABSENT
        self.shared.write(offset, raw)
        self._hold(index, offset, len(raw), upcoming)
        self.pins[index] = 1
        self.shared.set_entry(index, RAM, offset, len(raw))
        victims = self.ram.offer(index, len(raw), upcoming)
        if victims is None:
            self._add_staged(len(raw))
        else:
            self._evict(victims)
        return RAM

    def reserve(self, index: int, size: int, upcoming: int) -> bool:
        """A planned use of a sample the node does not hold, read by a worker (fill_ring.py): decide
        now, in plan order, whether the cache keeps it, and hold the room for its bytes. False when
        the shared area has no room now (bytes of published uses still pin it)."""
        offset = self.arena.alloc(size)
        if offset is None:
            return False
        victims = self.ram.offer(index, size, self.placement_key(index, upcoming))
        if victims is None:
            self.arena.free(offset)
            return True
        self.reserved[index] = offset
        self.reserved_size[index] = size
        self._evict(victims)
        return True

    def filled(self, index: int, raw: bytes, upcoming: int, decided: bool) -> int:
        """A worker's bytes for a sample it read: into its reserved room; offered now only if no
        decision was made when its use was published (`decided`: reserve() ran for it)."""
        offset, size = self.reserved.pop(index, None), self.reserved_size.pop(index, 0)
        if offset is None and decided:
            return self._keep_on_disk(index, raw, upcoming)  # the RAM tier bypassed or already evicted it
        if offset is not None:
            if len(raw) == size and index in self.ram:
                self.shared.write(offset, raw)
                self._hold(index, offset, size, self.ram.next[index])
                self.shared.set_entry(index, RAM, offset, size)
                return RAM
            self.arena.free(offset)
            if index in self.ram:
                self.ram.remove(index)
            return ABSENT
        return self.keep(index, raw, upcoming)

    def cancel_reservations(self) -> None:
        """Bytes that never came (a full fill ring, an epoch left early): not kept after all."""
        for index, offset in self.reserved.items():
            self.arena.free(offset)
            if index in self.ram:
                self.ram.remove(index)
        self.reserved.clear()
        self.reserved_size.clear()

    def keep(self, index: int, raw: bytes, upcoming: int) -> int:
        """A sample a worker read and used (fill_ring.py): keep it if placement says so, in RAM or
        else on disk. Nothing pins it. Returns the tier it is kept in, or ABSENT."""
        upcoming = self.placement_key(index, upcoming)
        offset = self.arena.alloc(len(raw))
        victims = self.ram.offer(index, len(raw), upcoming) if offset is not None else None
        if victims is not None:
            self.shared.write(offset, raw)
            self._hold(index, offset, len(raw), upcoming)
            self.shared.set_entry(index, RAM, offset, len(raw))
            self._evict(victims)
            return RAM
        if offset is not None:
            self.arena.free(offset)
        return self._keep_on_disk(index, raw, upcoming)

    def _keep_on_disk(self, index: int, raw: bytes, upcoming: int) -> int:
        if self._to_disk(index, raw, upcoming):
            self.shared.set_entry(index, DISK, 0, len(raw))
            return DISK
        return ABSENT

    def release(self, index: int, tier: int) -> None:
        """A published use was consumed: unpin, and free what nothing keeps any more."""
        if tier == RAM:
            left = self.pins[index] - 1
            if left:
                self.pins[index] = left
            else:
                del self.pins[index]
                if index not in self.ram:
                    self._drop(index)
        elif tier == DISK:
            left = self.disk_pending[index] - 1
            if left:
                self.disk_pending[index] = left
            else:
                del self.disk_pending[index]

    def copy_of(self, index: int) -> bytes | None:
        """The bytes of a held sample (for a peer), or None."""
        offset = self.held.get(index)
        if offset is not None:
            return self.shared.read(offset, self.held_size[index])
        if self.on_disk(index):
            return read_file(self.disk.path(index), int(self.shared.table[index, LENGTH]))
        return None

    def usage(self) -> dict:
        disk = self.disk_set
        return {
            "cache_ram_bytes": self.ram.used,
            "cache_ram_peak_bytes": self.ram.peak,
            "cache_ram_samples": len(self.ram),
            "staging_bytes": self.staged_bytes,
            "staging_peak_bytes": self.staged_peak,
            "cache_disk_bytes": disk.used if disk else 0,
            "cache_disk_peak_bytes": disk.peak if disk else 0,
            "cache_disk_samples": len(disk) if disk else 0,
            "disk_tier_enabled": bool(self.disk and self.disk.enabled),
        }

    # --- eviction ------------------------------------------------------------------------------
    def _evict(self, victims: list[int]) -> None:
        for victim in victims:
            if victim in self.reserved:
                self.arena.free(self.reserved.pop(victim))
                del self.reserved_size[victim]
                continue
            self._add_staged(self.held_size[victim])  # out of the cache set; its bytes stay while pinned
            if victim not in self.pins:
                self._drop(victim)

    def _evict_one(self) -> bool:
        """Room for a sample needed now: evict the farthest-used cached one that is not pinned."""
        for index in self.ram.farthest_first():
            if index in self.held and index not in self.pins:
                self.ram.remove(index)
                self._add_staged(self.held_size[index])
                self._drop(index)
                return True
        return False

    def _drop(self, index: int) -> None:
        """Free a sample's shared bytes; keep it on the disk tier if placement says so."""
        offset, size = self.held.pop(index), self.held_size.pop(index)
        next_use = self.held_next.pop(index, NEVER)
        self.staged_bytes -= size
        kept = self._to_disk(index, self.shared.read(offset, size), next_use)
        self.shared.set_entry(index, DISK if kept else ABSENT, 0, size if kept else 0)
        self.arena.free(offset)

    def _to_disk(self, index: int, raw: bytes, upcoming: int) -> bool:
        """Keep a sample on the disk tier if placement says so."""
        if self.disk_set is None or not self.disk.enabled:
            return False
        victims = self.disk_set.offer(
            index, len(raw), upcoming, can_evict=lambda victim: not self.disk_pending.get(victim)
        )
        if victims is None:
            return False
        for victim in victims:
            self.shared.set_entry(victim, ABSENT)
            self.disk.remove(victim)
        if self.disk.write(index, raw):
            return True
        self.disk_set.remove(index)
        return False

    def _hold(self, index: int, offset: int, size: int, next_use: int) -> None:
        self.held[index] = offset
        self.held_size[index] = size
        self.held_next[index] = next_use

    def hold_all(self, indices: list[int], offsets: list[int], sizes: list[int]) -> None:
        """Samples kept in free room of a resident epoch (resident.py): unpinned, no next use."""
        self.held.update(zip(indices, offsets))
        self.held_size.update(zip(indices, sizes))
        self.held_next.update(dict.fromkeys(indices, NEVER))
        self.ram.add_free(indices, sizes)

    def _add_staged(self, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self.staged_peak = max(self.staged_peak, self.staged_bytes)
