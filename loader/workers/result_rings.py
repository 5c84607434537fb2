"""Workers hand their batches' tensors to the main process through rings of shared memory.

torch's worker collates each batch into a fresh shared-memory file (default_collate does so
whenever get_worker_info() is set), and the result queue sends that file's descriptor over a
socket of multiprocessing's resource sharer: a connection, an HMAC challenge and a thread
hand-off per tensor, in both processes. On fast storage that is about a third of the CPU a
batch costs (`python -m tests.bench loader`, CPU per sample against torch).

Here each worker of an iterator owns one ring in a segment the iterator made (one writer, the
worker; one reader, the main process). The worker pickles the batch itself: each plain CPU
tensor's storage is copied into its ring and pickled as a reference (offset, length, dtype,
shape, strides); the main process copies the bytes out into an ordinary tensor as it takes
the batch from the queue, and gives the room back. Views of one storage stay views of one
storage, as torch's transfer keeps them. What does not fit (the ring is full, a storage
larger than the ring), a tensor already in shared memory, and anything that is not a plain
CPU tensor travel as torch sends them. `torch.utils.data.default_collate` runs in the worker
with get_worker_info() unset, so that it stacks into ordinary memory (the only thing it
reads the worker info for); a collate_fn of the caller's sees the worker info as with torch.

Per ring: freed [1] int64 (bytes the main process has given back, a cursor over all laps),
then RING_BYTES of data, of which the worker uses a part sized to its results (Sender). The
worker keeps its write cursor in its own memory; a storage never wraps (the cursor skips to
the next lap). Results of one worker reach the main process in
the order it sent them, so the main process frees by setting the cursor a result carries.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import weakref
from multiprocessing import shared_memory
from multiprocessing.reduction import ForkingPickler

import torch
import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import default_collate

from loader.cache.ram import PREFIX, shm_free_bytes
from loader.cache.reclaim import create_segment, reclaim_shared_memory, release

RING_BYTES = 16 << 20  # per worker, at most
LAP_RESULTS = 8  # copies of a worker's first tensor its ring holds (at least MIN_RING_BYTES)
_MIB = 1 << 20
SHM_SHARE = 1 / 16  # of /dev/shm's free space the rings of one iterator may take
MIN_RING_BYTES = 1 << 20
ALIGN = 64
_HEAD = ALIGN  # bytes before each ring's data: its freed cursor


class ResultRings:
    """The iterator's segment: one ring per worker. Pickles as its name for spawn workers."""

    def __init__(self, workers: int, ring_bytes: int, name: str | None = None):
        self.workers, self.ring_bytes = workers, ring_bytes
        total = workers * (_HEAD + ring_bytes)
        self.owner = name is None
        if self.owner:
            reclaim_shared_memory(PREFIX)
            self._shm, lock = create_segment(PREFIX, total)  # locked while we live (reclaim.py)
            name = self._shm.name
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:  # the main process writes only the freed cursors: their pages are reserved now
                for ring in range(workers):
                    os.posix_fallocate(fd, ring * (_HEAD + ring_bytes), _HEAD)
            except OSError:
                self._shm.close()
                self._shm.unlink()
                release(lock)
                raise
            finally:
                os.close(fd)
            self._finalizer = weakref.finalize(self, _release, self._shm, os.getpid(), lock)
            buffer = self._shm.buf
        else:  # a spawned worker: attach by path, unregistered, so its exit never unlinks the segment
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                buffer = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        self.name = name
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self.words = self.bytes.view(torch.int64)
        self.address = self.bytes.data_ptr()

    def freed_word(self, ring: int) -> int:
        """Index in `words` of ring `ring`'s freed cursor (the last word before its data)."""
        return self.start(ring) // 8 - 1

    @classmethod
    def for_iterator(cls, workers: int) -> ResultRings | None:
        """Rings for an iterator's workers, or None where /dev/shm has no room to spare for them."""
        if workers < 1:
            return None
        ring = RING_BYTES
        free = shm_free_bytes()
        if free is not None:
            ring = min(ring, int(free * SHM_SHARE) // workers // ALIGN * ALIGN)
        if ring < MIN_RING_BYTES:
            return None
        try:
            return cls(workers, ring)
        except OSError:
            return None

    def __getstate__(self):
        return {"workers": self.workers, "ring_bytes": self.ring_bytes, "name": self.name}

    def __setstate__(self, state):
        self.__init__(state["workers"], state["ring_bytes"], state["name"])

    def start(self, ring: int) -> int:
        """Byte offset of ring `ring`'s data in the segment."""
        return ring * (_HEAD + self.ring_bytes) + _HEAD

    def close(self) -> None:
        """Main process, once no worker writes any more: unmap and unlink."""
        if self.owner:
            self._finalizer()


def _release(shm: shared_memory.SharedMemory, owner: int, lock: int) -> None:
    if os.getpid() != owner:  # a forked worker's copy: the segment is the main process's
        return
    try:
        shm.close()
    except BufferError:  # a view still alive: the mapping goes with it
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
    release(lock)


class Shipped:
    """A result as it crosses the queue: the pickled batch, its ring and the ring's cursor after it."""

    __slots__ = ("ring", "payload", "end")

    def __init__(self, ring: int, payload: bytes, end: int):
        self.ring, self.payload, self.end = ring, payload, end

    def __reduce__(self):
        return Shipped, (self.ring, self.payload, self.end)


class Sender:
    """Worker side: pickles results, copying plain CPU tensors' storages into the worker's ring.

    A worker cycles through as much of its ring as LAP_RESULTS copies of its first result need
    (at least MIN_RING_BYTES), so that the copies stay in the processor's caches, and reserves
    those pages as it first writes them: a page /dev/shm has no room for makes that tensor go as
    torch sends it, never a SIGBUS."""

    def __init__(self, rings: ResultRings, ring: int):
        self.rings, self.ring = rings, ring
        self.base = rings.start(ring)
        self.size: int | None = None  # bytes of the ring this worker cycles through, once chosen
        self.reserved = 0  # bytes of it reserved in /dev/shm
        self.fd: int | None = None
        self.freed_word = rings.freed_word(ring)
        self.written = 0  # cursor over all laps

    def pack(self, data) -> Shipped:
        if self.size is None:
            first = LAP_RESULTS * _tensor_bytes(data)
            self.size = min(self.rings.ring_bytes, max(MIN_RING_BYTES, -(-first // _MIB) * _MIB))
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump(data)
        return Shipped(self.ring, buffer.getvalue(), self.written)

    def alloc(self, n: int) -> int | None:
        """Where n bytes go (an offset in the ring), or None without room."""
        size, cursor = self.size, self.written
        if cursor % size + n > size:
            cursor += size - cursor % size  # to the start of the next lap
        if cursor + n - int(self.rings.words[self.freed_word]) > size:
            return None
        start = cursor % size
        if start + n > self.reserved and not self._reserve(start + n):
            return None
        self.written = cursor + -(-n // ALIGN) * ALIGN
        return start

    def _reserve(self, end: int) -> bool:
        end = min(self.size, -(-end // _MIB) * _MIB)
        try:
            if self.fd is None:
                self.fd = os.open(f"/dev/shm/{self.rings.name}", os.O_RDWR)
            os.posix_fallocate(self.fd, self.base + self.reserved, end - self.reserved)
        except OSError:
            return False  # /dev/shm is full: this tensor goes as torch sends it
        self.reserved = end
        return True


class _Pickler(ForkingPickler):
    def __init__(self, file, sender: Sender):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.sender = sender
        self.placed: dict[int, int] = {}  # storage data_ptr -> offset in the ring, within this result

    def persistent_id(self, obj):
        if type(obj) is not torch.Tensor or not _plain(obj):
            return None
        storage = obj.untyped_storage()
        n = storage.nbytes()
        key = storage.data_ptr()
        start = self.placed.get(key) if n else None
        if start is None:
            sender = self.sender
            start = sender.alloc(n)
            if start is None:
                return None  # no room: torch's own transfer
            if n:
                ctypes.memmove(sender.rings.address + sender.base + start, storage.data_ptr(), n)
                self.placed[key] = start
        dtype = str(obj.dtype).removeprefix("torch.")
        return ("prescient.tensor", start, n, dtype, tuple(obj.size()), obj.stride(), obj.storage_offset())


def _tensor_bytes(data, depth: int = 0) -> int:
    """Bytes of the plain tensors in a result, looking into lists, tuples and dicts."""
    if isinstance(data, torch.Tensor):
        return data.untyped_storage().nbytes() if type(data) is torch.Tensor and _plain(data) else 0
    if depth > 4:
        return 0
    if isinstance(data, dict):
        data = data.values()
    elif not isinstance(data, (list, tuple)):
        return 0
    return sum(_tensor_bytes(item, depth + 1) for item in data)


def _plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_shared()
    )


class Receiver:
    """Main process side: rebuilds results and gives their ring room back."""

    def __init__(self, rings: ResultRings):
        self.rings = rings

    def unpack(self, shipped: Shipped):
        rings = self.rings
        try:
            return _Unpickler(io.BytesIO(shipped.payload), rings, rings.start(shipped.ring)).load()
        finally:
            rings.words[rings.freed_word(shipped.ring)] = shipped.end


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, rings: ResultRings, base: int):
        super().__init__(file)
        self.rings, self.base = rings, base
        self.storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid):
        tag, start, n, dtype, size, stride, offset = pid
        if tag != "prescient.tensor":
            raise pickle.UnpicklingError(f"unknown reference {tag!r} in a worker's result")
        storage = self.storages.get(start) if n else None
        if storage is None:
            # a plain memmove: a tensor copy here would wake torch's intra-op threads, which on a
            # machine the workers keep busy costs ten times the copy
            storage = torch.UntypedStorage(n)
            ctypes.memmove(storage.data_ptr(), self.rings.address + self.base + start, n)
            if n:
                self.storages[start] = storage
        return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, size, stride)


def worker_collate(collate_fn):
    """The collate function a worker with rings runs: torch's default_collate stacks into ordinary
    memory (the rings carry it), any other function is the caller's, untouched."""
    if collate_fn is not default_collate:
        return collate_fn
    return _collate_unshared


def _collate_unshared(batch):
    info = torch_worker._worker_info
    torch_worker._worker_info = None
    try:
        return default_collate(batch)
    finally:
        torch_worker._worker_info = info
