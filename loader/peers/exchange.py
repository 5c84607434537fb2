"""Peer exchange: a rank gets the samples another rank already holds instead of reading
them from shared storage again.

The plan is a window of positions ahead of the prefetcher. For each window every rank
runs the same four non-blocking gloo collectives on the loader's own process group:
  needs    all_gather: the indices each rank would otherwise read from storage
  holders  all_gather: for every request, whether this rank holds it (RAM or disk)
  sizes    all_to_all: the byte size and CRC-32 of every sample a sender will send
  payload  all_to_all: the bytes
Every rank derives the same sender for every request (one of its holders, by index), so
no further agreement is needed. Bytes a rank will serve are copied when it answers the
`holders` phase, so its own evictions meanwhile cannot change them. The coordinator polls
`poll()`; it never blocks in a collective, so a slow peer never stops local prefetching.

A peer is checked, not trusted. Each size a sender announces must be the sample's size
where the dataset states it (`nbytes`), and neither a sample nor all a sender sends in one
window may exceed what a peer's caches can hold (SizeRule); the bytes that arrive must
match the sender's CRC-32. A receiver drops whatever a sender that broke a rule sent in
the window (those samples come from storage), finishes the window's collectives, and
names the sender in the next window's `needs` (one slot per rank): every rank sees it in
the same collective and leaves the exchange there, as from a lost peer, the sender too,
and at the next epoch the others regroup without it. Sizes beyond what a peer can hold
are never allocated: that receiver leaves at once, and the others find the sender named
in the store when their next phase times out.

All ranks must construct the loader together and iterate whole epochs (as DDP does): the
collectives pair up window by window.

A rank that dies or stalls: a phase that fails (gloo reports the closed connection) or is
not done within `timeout` seconds raises PeerFailure, naming the ranks at fault from the
heartbeats (peer_health.py). The prefetcher then leaves the exchange: the window's samples
and the rest of the epoch come from its own cache or storage, so the epoch still ends with
the right batches; at the next epoch the survivors regroup (peer_cluster.py). The loader's
group is built with the same timeout, so gloo itself ends a collective left waiting and no
thread outlives it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loader.peers.health import PeerHealth, default_store


class PeerFailure(RuntimeError):
    """A window's collective failed or timed out; the message names the ranks at fault."""

    def __init__(self, message: str, rank: int, suspects: list[int]):
        super().__init__(message)
        self.rank = rank  # the (global) rank that gave up
        self.suspects = suspects  # global ranks found at fault (dead, stopped or behind)


@dataclass(frozen=True)
class SizeRule:
    """The sizes a peer may announce: a sample's own size where the dataset states it, and in any
    case no more than a peer can hold (a peer serves only what its shared-memory arena, cache and
    staging, and its disk tier hold; every rank is built with the same sizes)."""

    known: Callable[[int], int | None]  # the dataset's size of a sample (bytes), None if unknown
    most: int  # bytes one peer holds at most: no sample, nor one sender's window, is larger

    def unsafe(self, sender_sizes: list[tuple[int, int]]) -> str | None:
        """Why one sender's (index, size) announcements for a window cannot even be received
        (more than a peer holds), or None."""
        for index, size in sender_sizes:
            if not 0 <= size <= self.most:
                return f"announced {size} bytes for sample {index}, more than a peer can hold ({self.most})"
        total = sum(size for _, size in sender_sizes)
        if total > self.most:
            return f"announced {total} bytes in one window, more than a peer can hold ({self.most})"
        return None

    def wrong(self, sender_sizes: list[tuple[int, int]]) -> str | None:
        """Why a sender's announced sizes are not the dataset's, or None."""
        for index, size in sender_sizes:
            known = self.known(index)
            if known is not None and size != known:
                return (
                    f"announced {size} bytes for sample {index}, which must be {known} (the dataset's size)"
                )
        return None


ANY_SIZE = SizeRule(known=lambda index: None, most=1 << 62)


class PeerExchange:
    def __init__(
        self, group, window: int, timeout: float = 60.0, prefix: str = "", members: list[int] | None = None
    ):
        """`prefix`: store keys of this loader's exchange (peer_health.py); `members`: the global
        ranks of `group` in group order (all ranks when None)."""
        self.group = group
        self.window = window  # samples per exchange window
        self.timeout = timeout  # seconds one phase may wait for the other ranks
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.members = members or list(range(self.world))
        self.global_rank = self.members[self.rank]
        self.health = PeerHealth(default_store(), prefix, self.members, self.rank)
        self.phase: str | None = None  # None: idle
        self.work = None
        self.since = 0.0  # when the current phase began (time.monotonic)
        self.windows = 0  # windows begun
        self.sent = 0  # samples this rank served to peers
        self.accusing: dict[int, str] = {}  # senders (group ranks) found sending bad data, not yet named

    @property
    def busy(self) -> bool:
        return self.phase is not None

    def start(self, needs: list[int]) -> None:
        """Begin a window: `needs` are the indices this rank has no copy of (at most `window`)."""
        mine = torch.full((self.window + 2,), -1, dtype=torch.int64)  # count, a bad sender or -1, needs
        mine[0] = len(needs)
        mine[1] = next(iter(self.accusing), -1)
        mine[2 : 2 + len(needs)] = torch.as_tensor(needs, dtype=torch.int64)
        self._gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self.windows += 1
        self.health.beat(self.windows)
        self.phase, self.since = "needs", time.monotonic()
        self.work = self._collective(
            lambda: dist.all_gather(self._gathered, mine, group=self.group, async_op=True)
        )

    def _collective(self, post):
        try:
            return post()
        except Exception as error:  # noqa: BLE001 - a dead peer's closed connection
            self._fail(_first_sentence(error))

    def _fail(self, what: str) -> None:
        phase, work, self.phase, self.work = self.phase, self.work, None, None
        if work is not None:  # the group's own timeout ends it: no gloo thread outlives the exchange
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the failure being reported
                pass
        self.health.leave()
        found = self.health.culprits()
        raise PeerFailure(
            f"window {self.windows} ({phase}): {what}; {found}", self.global_rank, self.health.suspects
        )

    def _accuse(self, sender: int, what: str) -> None:
        """`sender` broke a rule this window: its samples are dropped, and it is named in the next
        window's `needs` (and in the store, with the reason, for the others' messages)."""
        if sender not in self.accusing:
            self.accusing[sender] = what
            self.health.accuse(sender, what)

    def _condemn(self, culprits: dict[int, str | None]) -> None:
        """Leave the exchange, as every rank does in this same collective: `culprits` (group ranks,
        with the reason where known) sent bad data."""
        self.phase, self.work, self._serve, self.accusing = None, None, {}, {}
        self.health.leave()
        named = "; ".join(
            f"rank {self.members[r]} sent bad data ({why or self.health.accusation(r) or 'found by a peer'})"
            for r, why in culprits.items()
        )
        raise PeerFailure(
            f"window {self.windows} (needs): {named}", self.global_rank, [self.members[r] for r in culprits]
        )

    def _reject(self, sender: int, what: str) -> None:
        """A sender announced more than could be received: leave now (nothing is allocated for it)."""
        phase, self.phase, self.work, self._serve = self.phase, None, None, {}
        culprit = self.members[sender]
        self.health.accuse(sender, what)
        self.health.leave()
        raise PeerFailure(
            f"window {self.windows} ({phase}): rank {culprit} sent bad data: {what}",
            self.global_rank,
            [culprit],
        )

    def _payload(self, chunks: list[bytes]) -> torch.Tensor:
        """The bytes this rank sends in the payload phase, all receivers' in order."""
        if not chunks:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    def poll(
        self, holding: Callable[[int], bytes | None], rule: SizeRule = ANY_SIZE
    ) -> dict[int, bytes] | None:
        """Advance when the current collective is done; the received samples once the window is.
        Raises PeerFailure when the collective failed or waited more than `timeout` seconds, or a
        peer sent what `rule` does not allow or bytes that fail their checksum."""
        self.health.beat()
        if self.phase is None:
            return None
        if not self.work.is_completed():
            if time.monotonic() - self.since > self.timeout:
                self._fail(f"no answer within peer_timeout={self.timeout:g} s")
            return None
        try:
            self.work.wait()
        except Exception as error:  # noqa: BLE001 - gloo's error for a peer that went away
            self._fail(_first_sentence(error))
        self.since = time.monotonic()
        if self.phase == "needs":
            culprits: dict[int, str | None] = {}
            for rank, gathered in enumerate(self._gathered):
                count, accused = int(gathered[0]), int(gathered[1])
                if not 0 <= count <= self.window:
                    culprits[rank] = f"asked for {count} samples in a window of {self.window}"
                elif 0 <= accused < self.world:
                    culprits.setdefault(accused, self.accusing.get(accused))
            if culprits:
                self._condemn(culprits)
            self.requests = [g[2 : 2 + int(g[0])].tolist() for g in self._gathered]
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
            self.phase = "holders"
            self.work = self._collective(
                lambda: dist.all_gather(self._flags, flags, group=self.group, async_op=True)
            )
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
            sizes_out = torch.tensor(  # (size, CRC-32) per sample
                [[len(self._serve[i]), zlib.crc32(self._serve[i])] for dest in outgoing for i in dest],
                dtype=torch.int64,
            ).reshape(-1)
            self._sizes_in = torch.empty(2 * sum(len(s) for s in self.incoming), dtype=torch.int64)
            self.phase = "sizes"
            self.work = self._collective(
                lambda: dist.all_to_all_single(
                    self._sizes_in,
                    sizes_out,
                    [2 * len(s) for s in self.incoming],
                    [2 * len(d) for d in outgoing],
                    group=self.group,
                    async_op=True,
                )
            )
            return None
        if self.phase == "sizes":
            announced = self._sizes_in.view(-1, 2).tolist()
            sizes = [size for size, _ in announced]
            per_sender, at = [], 0
            for sender in range(self.world):
                count = len(self.incoming[sender])
                announced_by = list(zip(self.incoming[sender], sizes[at : at + count]))
                unsafe = rule.unsafe(announced_by)
                if unsafe is not None:
                    self._reject(sender, unsafe)  # before anything is allocated for its bytes
                wrong = rule.wrong(announced_by)
                if wrong is not None:
                    self._accuse(sender, wrong)  # received (bounded) and dropped with the window
                per_sender.append(sum(sizes[at : at + count]))
                at += count
            payload = self._payload([self._serve[i] for dest in self._outgoing for i in dest])
            self._sizes, self._crcs = sizes, [crc for _, crc in announced]
            self._payload_in = torch.empty(sum(sizes), dtype=torch.uint8)
            out_split = [sum(len(self._serve[i]) for i in dest) for dest in self._outgoing]
            self.sent += sum(len(d) for d in self._outgoing)
            self.phase = "payload"
            self.work = self._collective(
                lambda: dist.all_to_all_single(
                    self._payload_in, payload, per_sender, out_split, group=self.group, async_op=True
                )
            )
            return None
        received, offset, at = {}, 0, 0
        data = self._payload_in.numpy().tobytes()
        for sender, indices in enumerate(self.incoming):
            mine = {}
            for index in indices:
                size, crc = self._sizes[at], self._crcs[at]
                mine[index] = data[offset : offset + size]
                if zlib.crc32(mine[index]) != crc:
                    self._accuse(sender, f"the bytes of sample {index} do not match their CRC-32")
                offset += size
                at += 1
            if sender not in self.accusing:  # a sender found bad: none of its samples are used
                received.update(mine)
        self.phase, self.work, self._serve = None, None, {}
        return received

    def finish(self, holding: Callable[[int], bytes | None], rule: SizeRule = ANY_SIZE) -> dict[int, bytes]:
        """Complete a window in flight (all ranks do the same at an epoch change); raises
        PeerFailure as poll does."""
        while self.busy:
            received = self.poll(holding, rule)
            if received is not None:
                return received
            time.sleep(0.0005)
        return {}


def _first_sentence(error: BaseException) -> str:
    """gloo's message without its source location and advice: 'Connection closed by peer [host]:port'."""
    text = str(error).split("] ", 1)[-1] if str(error).startswith("[") else str(error)
    return f"{type(error).__name__}: {text.split('. ', 1)[0]}"
