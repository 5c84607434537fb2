"""Peer exchange: a rank gets the samples another rank already holds instead of reading
them from shared storage again.

The plan is a window of positions ahead of the prefetcher. For each window every rank
runs the same four non-blocking gloo collectives on the loader's own process group:
  needs    all_gather: the indices each rank would otherwise read from storage
  holders  all_gather: for every request, whether this rank holds it (RAM or disk)
  sizes    all_to_all: the byte size of every sample a sender will send
  payload  all_to_all: the bytes
Every rank derives the same sender for every request (one of its holders, by index), so
no further agreement is needed. Bytes a rank will serve are copied when it answers the
`holders` phase, so its own evictions meanwhile cannot change them. The coordinator polls
`poll()`; it never blocks in a collective, so a slow peer never stops local prefetching.

All ranks must construct the loader together and iterate whole epochs (as DDP does): the
collectives pair up window by window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class PeerExchange:
    def __init__(self, group, window: int):
        self.group = group
        self.window = window  # samples per exchange window
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.phase: str | None = None  # None: idle
        self.work = None
        self.sent = 0  # samples this rank served to peers

    @property
    def busy(self) -> bool:
        return self.phase is not None

    def start(self, needs: list[int]) -> None:
        """Begin a window: `needs` are the indices this rank has no copy of (at most `window`)."""
        mine = torch.full((self.window + 1,), -1, dtype=torch.int64)
        mine[0] = len(needs)
        mine[1 : 1 + len(needs)] = torch.as_tensor(needs, dtype=torch.int64)
        self._gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self.work = dist.all_gather(self._gathered, mine, group=self.group, async_op=True)
        self.phase = "needs"

    def poll(self, holding: Callable[[int], bytes | None]) -> dict[int, bytes] | None:
        """Advance when the current collective is done; the received samples once the window is."""
        if self.phase is None or not self.work.is_completed():
            return None
        self.work.wait()
        if self.phase == "needs":
            self.requests = [g[1 : 1 + int(g[0])].tolist() for g in self._gathered]
            self._serve: dict[int, bytes] = {}
            flags = torch.zeros(sum(len(r) for r in self.requests), dtype=torch.uint8)
            at = 0
            for rank, wanted in enumerate(self.requests):
                for index in wanted:
                    if rank != self.rank:
                        raw = self._serve.get(index) or holding(index)
                        if raw is not None:
                            self._serve[index] = raw
                            flags[at] = 1
                    at += 1
            self._flags = [torch.empty_like(flags) for _ in range(self.world)]
            self.work = dist.all_gather(self._flags, flags, group=self.group, async_op=True)
            self.phase = "holders"
            return None
        if self.phase == "holders":
            self.incoming = [[] for _ in range(self.world)]  # per sender: indices I receive, in order
            outgoing = [[] for _ in range(self.world)]  # per receiver: indices I send
            at = 0
            for rank, wanted in enumerate(self.requests):
                for index in wanted:
                    holders = [h for h in range(self.world) if self._flags[h][at]]
                    if holders:
                        sender = holders[index % len(holders)]
                        if rank == self.rank:
                            self.incoming[sender].append(index)
                        if sender == self.rank:
                            outgoing[rank].append(index)
                    at += 1
            self._outgoing = outgoing
            sizes_out = torch.tensor(
                [len(self._serve[i]) for dest in outgoing for i in dest], dtype=torch.int64
            )
            self._sizes_in = torch.empty(sum(len(s) for s in self.incoming), dtype=torch.int64)
            self.work = dist.all_to_all_single(
                self._sizes_in,
                sizes_out,
                [len(s) for s in self.incoming],
                [len(d) for d in outgoing],
                group=self.group,
                async_op=True,
            )
            self.phase = "sizes"
            return None
        if self.phase == "sizes":
            chunks = [self._serve[i] for dest in self._outgoing for i in dest]
            payload = (
                torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
                if chunks
                else torch.empty(0, dtype=torch.uint8)
            )
            sizes = self._sizes_in.tolist()
            per_sender, at = [], 0
            for sender in range(self.world):
                count = len(self.incoming[sender])
                per_sender.append(sum(sizes[at : at + count]))
                at += count
            self._sizes = sizes
            self._payload_in = torch.empty(sum(sizes), dtype=torch.uint8)
            out_split = [sum(len(self._serve[i]) for i in dest) for dest in self._outgoing]
            self.sent += sum(len(d) for d in self._outgoing)
            self.work = dist.all_to_all_single(
                self._payload_in, payload, per_sender, out_split, group=self.group, async_op=True
            )
            self.phase = "payload"
            return None
        received, offset = {}, 0
        data = self._payload_in.numpy().tobytes()
        order = [i for sender in self.incoming for i in sender]
        for index, size in zip(order, self._sizes):
            received[index] = data[offset : offset + size]
            offset += size
        self.phase, self.work, self._serve = None, None, {}
        return received

    def finish(self, holding: Callable[[int], bytes | None]) -> None:
        """Complete a window in flight (all ranks do the same at an epoch change)."""
        while self.busy:
            if self.poll(holding) is None and self.work is not None:
                self.work.wait()
