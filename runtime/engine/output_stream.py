"""OutputStream: where one request's deltas wait for the coroutine that reads them.

Both engine clients use it (runtime/engine/client.py). The producer (the engine thread for
AsyncEngine, the event loop reading the core's pipe for EngineCoreClient) put()s each
step's delta, or fail()s the stream with an exception; the consumer iterates
deltas(). Whatever accumulated between two reads comes out coalesced, one delta
per sequence, so a slow reader costs O(new items) per read and one list of
pending deltas in memory, and loses or repeats nothing. A failure is raised
after the deltas that came before it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from runtime.engine.errors import RequestFailedError
from runtime.engine.outputs import OutputDelta, coalesce


class OutputStream:
    __slots__ = ("loop", "event", "lock", "pending", "failure", "unfinished", "tenant")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int = 1, tenant: str = "default"):
        self.loop = loop
        self.tenant = tenant
        """Whose request this is (the engine client counts each tenant's requests in flight)."""
        self.event = asyncio.Event()  # only touched on `loop`
        self.lock = threading.Lock()
        self.pending: list[OutputDelta] = []
        self.failure: BaseException | None = None
        self.unfinished = n
        """The producer's count of the request's n sequences that have not finished."""

    def put(self, delta: OutputDelta) -> bool:
        """Hand over one delta (from any thread); True if it ends the request: its last sequence
        finished, or it failed (delta.error)."""
        if delta.error is not None:
            self.unfinished = 0
        elif delta.finished:
            self.unfinished -= 1
        with self.lock:
            wake = not self.pending and self.failure is None
            self.pending.append(delta)
        if wake:
            self._wake()
        return self.unfinished <= 0

    def fail(self, error: BaseException) -> None:
        """End the stream with an exception (from any thread); its reader raises it after what is pending."""
        with self.lock:
            wake = not self.pending and self.failure is None
            self.failure = error
        if wake:
            self._wake()

    def _wake(self) -> None:
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            self.event.set()
        else:
            self.loop.call_soon_threadsafe(self.event.set)

    async def deltas(self, n: int) -> AsyncIterator[OutputDelta]:
        """Yield deltas until all n sequences have finished; RequestFailedError for a failed one, or the
        exception the stream was failed with."""
        remaining = n
        while True:
            with self.lock:
                items, self.pending = self.pending, []
                failure = self.failure
                if not items:
                    self.event.clear()
            if not items:
                if failure is not None:
                    raise failure
                await self.event.wait()
                continue
            for delta in coalesce(items):
                if delta.error is not None:
                    raise RequestFailedError(delta)
                remaining -= delta.finished
                yield delta
                if remaining <= 0:
                    return
