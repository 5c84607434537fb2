"""Resident epochs: every sample the plan's horizon uses fits in the RAM cache at once.

Then placement has nothing to decide: Belady keeps every sample and evicts none, so no
position needs a pin (bytes never move while a worker reads them), no sample needs a
next-use key, and no room needs reserving in plan order. The coordinator works per chunk
of positions with numpy over the plan arrays instead of per sample: it publishes every
position it may at once, advances consumption by a vectorised scan of the done ring, and
copies the workers' fills straight from their rings into room carved for a whole chunk.

Whether an epoch is resident is decided at its start, from what is held and an estimate
of the size of what is not (sizes already seen, or a few nbytes() calls). An estimate that
proves low costs no correctness: a fill that finds no free room is simply not kept (it is
never allowed to evict), and the next epoch, seeing the cache full, runs placement sample
by sample again (prefetch.py, holdings.py), with Belady's keys renumbered from its plan.
"""

from __future__ import annotations

import numpy as np

from loader.cache.fill_ring import CURSOR, FREED, HEAD, INDEX, RECORDS, TAIL, FillRings
from loader.cache.fill_ring import LENGTH as BYTES
from loader.cache.holdings import Holdings
from loader.cache.ram import LENGTH, OFFSET, RAM, RAM_HITS, TIER, VERSION, SharedState
from loader.source import ByteSource

SIZE_PROBES = 32  # nbytes() calls that estimate the size of samples not seen yet
CONSUME_SCAN = 256  # positions the done ring is first scanned over; doubled while all are marked


def fits(holdings: Holdings, source: ByteSource, horizon: np.ndarray) -> bool:
    """Can every sample `horizon` uses be kept in RAM without evicting anything?"""
    if holdings.disk is not None or holdings.home is not None or holdings.reserved:
        return False  # the disk tier and peers' home samples need placement sample by sample
    if holdings.staged_bytes:
        return False  # bytes outside the cache set are still pinned
    ram = holdings.ram
    if horizon.size == 0:
        return True
    table = holdings.shared.table
    used = np.zeros(len(table), dtype=bool)
    used[horizon] = True  # a mask over the dataset: a tenth of np.unique's time on a shuffled plan
    unique = np.flatnonzero(used)
    tiers = table[unique, TIER]
    missing = unique[tiers != RAM]
    if missing.size == 0:
        return True
    if len(ram):
        mean = ram.used / len(ram)
    else:
        probes = missing[np.linspace(0, missing.size - 1, min(SIZE_PROBES, missing.size)).astype(np.int64)]
        sizes = [source.nbytes(int(i)) for i in probes]
        if any(size is None for size in sizes):
            return False  # sizes unknown: decided as the bytes come (holdings.keep)
        mean = sum(sizes) / len(sizes)
    need = int(missing.size * mean)
    return ram.used + need <= ram.capacity and need <= holdings.arena.size - holdings.arena.used


def publish(shared: SharedState, stream: np.ndarray, base: int, start: int, end: int) -> int:
    """Positions [start, end) may be read: ready[g % ring] = g + 1 for each, in one pass.
    Returns how many of them the node does not hold (the workers read and fill those)."""
    ready = shared.ready
    ring = len(ready)
    tags = np.arange(base + start, base + end, dtype=np.int64)
    hits = int(np.count_nonzero(shared.table[stream[start:end], TIER] == RAM))
    shared.counters[0, RAM_HITS] += hits
    ready[tags % ring] = tags + 1
    return end - start - hits


def consumed_up_to(shared: SharedState, base: int, consumed: int, done: int) -> int:
    """The first position in [consumed, done) whose done mark is missing (done if none is)."""
    ring, scan = len(shared.done), CONSUME_SCAN
    while consumed < done:
        stop = min(done, consumed + scan)
        tags = np.arange(base + consumed, base + stop, dtype=np.int64)
        marked = shared.done[tags % ring] == tags + 1
        if not marked.all():
            return consumed + int(np.argmin(marked))
        consumed, scan = stop, scan * 2
    return consumed


def take_fills(fills: FillRings, holdings: Holdings) -> bool:
    """Keep what the workers read, in free room only: copied from each ring straight into the
    data area, the table written per chunk. Returns whether any record was taken."""
    taken = False
    shared = holdings.shared
    for ring in range(len(fills.ctl)):
        ctl = fills.ctl[ring]
        head, tail = int(ctl[HEAD]), int(ctl[TAIL])
        if head == tail:
            continue
        taken = True
        slots = np.arange(tail, head) % RECORDS
        records = fills.records[ring, slots]
        _keep(holdings, shared, fills, ring, records)
        last = records[-1]
        ctl[FREED] = int(last[CURSOR]) + int(last[BYTES])
        ctl[TAIL] = head
    return taken


def _keep(holdings: Holdings, shared: SharedState, fills: FillRings, ring: int, records: np.ndarray) -> None:
    indices = records[:, INDEX]
    _, first = np.unique(indices, return_index=True)  # a sample read twice is kept once
    records = records[np.sort(first)]
    records = records[shared.table[records[:, INDEX], TIER] != RAM]
    if not len(records):
        return
    ram = holdings.ram
    lengths = records[:, BYTES]
    room = ram.capacity - ram.used
    records = records[np.cumsum(lengths) <= room]  # never evicts: what does not fit is not kept
    if not len(records):
        return
    length_list = records[:, BYTES].tolist()
    offsets = holdings.arena.alloc_run(length_list)
    if offsets is not None:
        shared.populate(offsets[0], offsets[-1] + length_list[-1] - offsets[0])
    else:  # no free block holds the chunk: sample by sample, as far as room goes
        offsets = [holdings.arena.alloc(n) for n in length_list]
        records = records[np.array([offset is not None for offset in offsets], dtype=bool)]
        offsets = [offset for offset in offsets if offset is not None]
        length_list = records[:, BYTES].tolist()
    index_list = records[:, INDEX].tolist()
    data, ring_data, size = shared.data, fills.data, fills.ring_bytes
    base = ring * size
    for offset, cursor, n in zip(offsets, records[:, CURSOR].tolist(), length_list):
        start = base + cursor % size
        data[offset : offset + n] = ring_data[start : start + n]
    rows = records[:, INDEX]
    table = shared.table
    table[rows, VERSION] += 1  # odd: being changed
    table[rows, OFFSET] = offsets
    table[rows, LENGTH] = length_list
    table[rows, TIER] = RAM  # last: a worker that sees RAM finds the offset and length in place
    table[rows, VERSION] += 1
    holdings.hold_all(index_list, offsets, length_list)
