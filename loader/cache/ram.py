"""The RAM tier: one POSIX shared-memory segment that the main process writes and every
worker process reads in place (a memcpy, never a pickle through a queue).

Layout, all int64 unless noted:
  header   [16]          mode, generation base, coordinator alive
  counters [rows, 16]    per process: row 0 prefetcher, 1 main process, 2+w worker w
  table    [n, 4]        per sample: tier, offset, length, version
  ready    [ring]        ready[g % ring] == g + 1: plan position g may be read
  done     [ring]        done[g % ring]  == g + 1: plan position g was read, its bytes may go
  snaps    [slots, B]    uint8: worker RNG states at batch boundaries (for exact resume)
  fill_*   [rings, ...]  the workers' fill rings (fill_ring.py): bytes they read, for the cache
  data     [arena]       uint8: sample bytes (cached and staged)

The segment is created with multiprocessing's SharedMemory, so the resource tracker
unlinks it even if the main process is killed (and the next loader reclaims it if the tracker
died too, see reclaim.py); its pages are reserved up front, so several loaders on a node
never overcommit /dev/shm; workers started with spawn attach by path
without registering, so their exit never unlinks what the main process still uses.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

from loader.cache.fill_ring import RECORDS, FillRings
from loader.cache.reclaim import create_segment, reclaim_shared_memory, release
from loader.plan.rng_state import RNG_STATE_BYTES

PREFIX = "prescient_"
MADV_POPULATE_WRITE = 23  # Linux 5.14+: map a range's pages for writing in one call
_libc = ctypes.CDLL(None, use_errno=True)

# header fields
MODE, GEN_BASE, ALIVE = 0, 1, 2
PLANNED, DIRECT = 0, 1
# table columns and tiers
TIER, OFFSET, LENGTH, VERSION = 0, 1, 2, 3
ABSENT, RAM, DISK, FAILED = 0, 1, 2, 3
# counter columns
(
    SAMPLES,
    STORAGE_READS,
    STORAGE_BYTES,
    RAM_HITS,
    DISK_HITS,
    PEER_READS,
    STALL_NS,
    WAIT_NS,
    DIRECT_READS,
    BATCHES,
) = range(10)
COUNTERS = 16
SNAP_BYTES = 16 + RNG_STATE_BYTES


class SharedMemoryFull(MemoryError):
    """/dev/shm has no room for the loader's segment."""


def shm_free_bytes() -> int | None:
    try:
        fs = os.statvfs("/dev/shm")
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


@dataclass(frozen=True)
class Layout:
    samples: int  # rows in the table (len(dataset))
    rows: int  # counter rows (processes)
    ring: int  # plan positions that may be in flight at once
    snap_slots: int  # RNG snapshot slots
    arena: int  # bytes for sample data
    fill_rings: int = 0  # one per reading process (fill_ring.py); 0: workers do not fill the cache
    fill_bytes: int = 0  # bytes of each fill ring

    def sections(self) -> dict[str, tuple[int, int]]:
        sizes = {
            "header": 16 * 8,
            "counters": self.rows * COUNTERS * 8,
            "table": self.samples * 4 * 8,
            "ready": self.ring * 8,
            "done": self.ring * 8,
            "snaps": self.snap_slots * SNAP_BYTES,
            "fill_ctl": self.fill_rings * 4 * 8,
            "fill_records": self.fill_rings * RECORDS * 4 * 8,
            "fill_data": self.fill_rings * self.fill_bytes,
            "data": self.arena,
        }
        out, offset = {}, 0
        for name, size in sizes.items():
            out[name] = (offset, size)
            offset += _aligned(size)
        return out

    @property
    def total(self) -> int:
        offset, size = self.sections()["data"]
        return offset + max(size, 64)


class SharedState:
    """The segment and numpy views of its sections. Pickles as (name, layout) for spawn workers."""

    def __init__(self, layout: Layout, name: str | None = None):
        self.layout = layout
        self._owner = name is None
        if self._owner:
            reclaim_shared_memory(PREFIX)  # segments of loaders that were killed
            self._shm, self._lock = create_segment(PREFIX, layout.total)  # locked while we live
            self.name = self._shm.name
            self._reserve(layout.total)
            self._buffer = self._shm.buf
        else:
            self.name = name
            self._shm = None
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, layout.total)
            finally:
                os.close(fd)
            self._buffer = memoryview(self._mmap)
        self._views()
        if self._owner:
            self.header[ALIVE] = 1

    def _reserve(self, size: int) -> None:
        """Allocate every page now. A tmpfs segment is sparse: a write to a page /dev/shm has no room
        for is a SIGBUS in whichever process touches it. Reserved, the segment either fits or fails
        here with an error, and the next loader on the node sees the space as taken."""
        fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # a file system that cannot reserve: sized by statvfs alone
            self._shm.close()
            self._shm.unlink()
            release(self._lock)
            free = shm_free_bytes()
            raise SharedMemoryFull(
                f"shared memory: cannot reserve {size:,} bytes in /dev/shm ({error.strerror}; {free:,} bytes "
                "free, the rest held by other loaders or processes on this node). Lower cache_ram or "
                "prefetch_bytes, or enlarge /dev/shm (docker run --shm-size=...)."
            ) from None
        finally:
            os.close(fd)

    def _views(self) -> None:
        sec = self.layout.sections()

        def view(name: str, dtype, shape) -> np.ndarray:
            offset, size = sec[name]
            return np.frombuffer(
                self._buffer, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=offset
            ).reshape(shape)

        lay = self.layout
        self.header = view("header", np.int64, (16,))
        self.counters = view("counters", np.int64, (lay.rows, COUNTERS))
        self.table = view("table", np.int64, (lay.samples, 4))
        self.ready = view("ready", np.int64, (lay.ring,))
        self.done = view("done", np.int64, (lay.ring,))
        self.snaps = view("snaps", np.uint8, (lay.snap_slots, SNAP_BYTES))
        self.fills = None
        if lay.fill_rings:
            offset, size = sec["fill_data"]
            self.fills = FillRings(
                view("fill_ctl", np.int64, (lay.fill_rings, 4)),
                view("fill_records", np.int64, (lay.fill_rings, RECORDS, 4)),
                self._buffer[offset : offset + size],
                lay.fill_bytes,
            )
        offset, size = sec["data"]
        self.data = self._buffer[offset : offset + size]
        probe = np.frombuffer(self.data, dtype=np.uint8, count=1) if size else None
        self._data_address = probe.ctypes.data if probe is not None else 0  # while the segment is mapped
        del probe
        self._populate = self._owner and bool(size)
        # Flat int64 memoryviews of the same bytes: scalar reads and writes on the workers'
        # hot path cost a fraction of numpy's.
        self.fast = {
            name: self._buffer[sec[name][0] : sec[name][0] + sec[name][1]].cast("q")
            for name in ("header", "counters", "table", "ready", "done")
        }

    def __getstate__(self):
        return {"layout": self.layout, "name": self.name}

    def __setstate__(self, state):
        self.__init__(state["layout"], state["name"])

    # --- publishing (main process only) -------------------------------------------------
    def set_entry(self, index: int, tier: int, offset: int = 0, length: int = 0) -> None:
        row = self.table[index]
        row[VERSION] += 1  # odd: being changed
        row[TIER], row[OFFSET], row[LENGTH] = tier, offset, length
        row[VERSION] += 1

    def write(self, offset: int, raw: bytes) -> None:
        self.data[offset : offset + len(raw)] = raw

    def populate(self, offset: int, length: int) -> None:
        """Map the data area's pages in [offset, offset + length) before writing them: one system
        call for a run of samples costs about half of faulting each page in on first touch.
        Where the kernel cannot (before Linux 5.14), the pages fault in as they are written."""
        if not self._populate or length <= 0:
            return
        page = mmap.PAGESIZE
        start = self._data_address + offset
        aligned = start - start % page
        if _libc.madvise(
            ctypes.c_void_p(aligned), ctypes.c_size_t(start + length - aligned), MADV_POPULATE_WRITE
        ):
            self._populate = False

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.data[offset : offset + length])

    # --- snapshots -------------------------------------------------------------------------
    def put_snapshot(self, slot: int, tag: int, state: torch.Tensor) -> None:
        """Store a worker's RNG state (uint8, see rng_state.py) under `tag`."""
        row = self.snaps[slot]
        head = row[:16].view(np.int64)
        head[0] = 0
        row[16 : 16 + RNG_STATE_BYTES] = state.numpy()
        head[1] = RNG_STATE_BYTES
        head[0] = tag

    def get_snapshot(self, slot: int, tag: int) -> torch.Tensor | None:
        row = self.snaps[slot]
        head = row[:16].view(np.int64)
        if head[0] != tag:
            return None
        state = torch.from_numpy(row[16 : 16 + RNG_STATE_BYTES].copy())
        return state if head[0] == tag else None

    # --- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap; the owner also unlinks, so the memory is gone once workers exit too."""
        if self._buffer is None:
            return
        if self._owner:
            self.header[ALIVE] = 0
            self.header[MODE] = DIRECT
        for view in self.fast.values():
            view.release()
        for name in ("header", "counters", "table", "ready", "done", "snaps", "data", "fast", "fills"):
            setattr(self, name, None)
        self._buffer = None
        if self._owner:
            try:
                self._shm.close()
            except BufferError:  # a numpy view still alive somewhere: the mapping goes with it
                pass
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            release(self._lock)
            self._lock = None
        else:
            try:
                self._mmap.close()
            except BufferError:
                pass
