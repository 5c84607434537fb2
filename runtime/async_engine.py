"""The engine on its own thread, fed and read from an asyncio event loop.

The event loop never runs the model: requests and aborts are queued to the
engine thread, which steps the engine and hands each output back to the
loop with call_soon_threadsafe. A consumer that stops iterating (client gone,
task cancelled) aborts its request at once, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from runtime.engine import Engine
from runtime.outputs import RequestOutput
from scheduler import SamplingParams

log = logging.getLogger("prescient.engine")


class QueueFullError(RuntimeError):
    """More requests are waiting than the server admits; retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; nothing more will be served."""


class RequestAbortedError(RuntimeError):
    """The server aborted this request (abort_all: shutdown after the drain timeout)."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its step raised); the engine keeps serving the others.

    `output` is the request's final output (what it had produced), `cause` says what failed."""

    def __init__(self, output: RequestOutput):
        super().__init__(f"request {output.request_id} failed: {output.error}")
        self.output = output
        self.cause = output.error


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._max_num_seqs = engine.scheduler.config.max_num_seqs
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats: dict = engine.stats()
        self._unfinished: dict[str, int] = {}
        """Engine thread only: request id -> how many of its n sequences have not finished."""
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prescient-engine", daemon=True)
            self._thread.start()

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (waiting, running, or about to be handed over)."""
        with self._lock:
            return len(self._sinks)

    def stats(self) -> dict:
        """The engine's stats as of its last step (safe to call from any thread)."""
        with self._lock:
            return dict(self._stats)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       *, tenant: str = "default", weight: float = 1.0, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield snapshots of the request's output as tokens arrive; the last one has finished=True.
        With params.n > 1 the snapshots of its n sequences interleave (RequestOutput.index tells which),
        and the stream ends when all n have finished."""
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an internal error")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic()
        # Validate on the caller's side so bad input fails before anything is queued.
        ids = self.engine.check_request(prompt, params)
        with self._lock:
            if self.error is not None:   # it died since the check above: never queue into a dead engine
                raise EngineDeadError("the engine stopped after an internal error")
            # Requests in flight that will not be in the running batch: those beyond what runs now, or
            # beyond max_num_seqs (a burst arrives before the engine thread has admitted anyone).
            in_flight = len(self._sinks)
            running = max(self._stats.get("num_running", 0), min(in_flight, self._max_num_seqs))
            waiting = in_flight - running
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are already waiting (limit {self.max_waiting})")
            if request_id in self._sinks:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._sinks[request_id] = (loop, queue)
            self._adds.append((request_id, ids, params, tenant, weight, priority, arrival, cache_salt))
            self._wake.notify()
        finished = False
        remaining = params.n   # sequences still running; the last one to finish ends the stream
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item)
                remaining -= item.finished
                finished = remaining == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._sinks.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._wake.notify()

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight now: each consumer gets RequestAbortedError(reason) and the
        engine frees their blocks. Returns how many there were."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            self._aborts.extend(sinks)
            self._wake.notify()
        for loop, queue in sinks.values():
            loop.call_soon_threadsafe(queue.put_nowait, RequestAbortedError(reason))
        return len(sinks)

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.abort_all("the engine has shut down")   # nobody may wait on a stopped engine

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._adds or self._aborts or engine.has_unfinished_requests()):
                        self._wake.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                # Adds first: a request added and abandoned during the same step must be added, then aborted.
                for request_id, ids, params, tenant, weight, priority, arrival, salt in adds:
                    self._unfinished[request_id] = params.n
                    try:
                        engine.add_request(request_id, ids, params, tenant=tenant, weight=weight,
                                           priority=priority, arrival_time=arrival, cache_salt=salt)
                    except ValueError as exc:
                        self._unfinished.pop(request_id, None)
                        self._deliver(request_id, exc, final=True)
                    except Exception as exc:   # a bug adding this one request: fail it, not the engine
                        log.exception("adding request %s failed", request_id)
                        engine.abort_request(request_id)
                        self._unfinished.pop(request_id, None)
                        self._deliver(request_id, RequestFailedError(RequestOutput(
                            request_id, list(ids), [], "", True, "abort", arrival_time=arrival,
                            error=f"{type(exc).__name__} while adding the request")), final=True)
                for request_id in aborts:
                    engine.abort_request(request_id)
                    self._unfinished.pop(request_id, None)
                outputs = engine.step() if engine.has_unfinished_requests() else []
                stats = engine.stats()
                with self._lock:
                    self._stats = stats
                for out in outputs:
                    final = out.error is not None   # a failed request ends at once, all its sequences with it
                    if out.finished and not final:   # the last of a request's n sequences ends its stream
                        left = self._unfinished.get(out.request_id, 1) - 1
                        self._unfinished[out.request_id] = left
                        final = left <= 0
                    if final:
                        self._unfinished.pop(out.request_id, None)
                    self._deliver(out.request_id, out, final=final)
        except BaseException as exc:  # keep serving errors visible instead of hanging clients
            log.exception("engine thread failed")
            with self._lock:   # with the error set under the lock, no request can slip in after the sweep
                self.error = exc
                sinks, self._sinks = self._sinks, {}
                self._adds.clear()
            for loop, queue in sinks.values():
                loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError("the engine failed"))

    def _deliver(self, request_id: str, item, final: bool) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None) if final else self._sinks.get(request_id)
        if sink is not None:
            loop, queue = sink
            loop.call_soon_threadsafe(queue.put_nowait, item)
