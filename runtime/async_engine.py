"""AsyncEngine: the in-process EngineClient. The engine runs on its own thread, fed and read from
an asyncio event loop.

The event loop never runs the model. A request is admitted (tokenized and
checked against the admission rule) on the caller's side, then queued to the
engine thread, which steps the engine and hands each output back to the loop
with call_soon_threadsafe. A consumer that stops iterating (client gone, task
cancelled) aborts its request at once, which frees its KV blocks. The whole
hand-off is described in Note [Engine thread <-> event loop] below.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from runtime.engine import Engine
from runtime.outputs import RequestOutput
from runtime.tokenizer import Tokenizer
from scheduler import InvalidRequestError, SamplingParams

log = logging.getLogger("prescient.engine")

# Note [Engine thread <-> event loop]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two kinds of actor share an AsyncEngine:
#
#   event loop thread   many coroutines (HTTP handlers): generate(), abort(), stats(), check_health()
#   engine thread       one loop, _run(): owns the Engine (scheduler, runner, KV cache, tensors)
#
# Everything they share is guarded by one threading.Lock, `_lock`, held only for list and dict
# operations, never while the model runs:
#
#   _sinks   {request_id: _Sink}  where a request's outputs go (one slot: the latest); present
#            exactly while the request is in flight (num_in_flight = len(_sinks))
#   _adds    admitted requests (_Add) not yet given to the Engine
#   _aborts  request ids to remove from the Engine
#   _stats   the scheduler's stats as of the last step
#   _stopping, error
#
#   event loop                                        engine thread
#   ----------                                        -------------
#   generate(): admit (tokenize, AdmissionRule)       wait on _wake until stopping, adds, aborts
#     on the caller's thread; errors raise here         or unfinished requests
#   lock: error? -> EngineDeadError                   lock: swap out _adds and _aborts
#         too many waiting? -> QueueFullError         engine.enqueue(each add)      <- adds first,
#         register sink, append _Add, notify ------>  engine.abort_request(each)    <- then aborts
#                                                     outputs = engine.step()        (no lock held)
#                                                     lock: _stats = engine.stats()
#   sink.pending <---- lock: sink.put(item) --------  for each output: lock: look up its sink
#     output -> yield it                                (pop it if the output is final), then
#     final output -> return                            hand the item to the sink's loop
#     an exception item -> raise it
#   leaving early (break, cancel, the client
#     went away) -> abort(): lock: pop the sink,
#     append to _aborts, notify ------------------->  (removed at the next iteration)
#
# Why it holds:
# * A sink holds only the latest item (each output holds everything before it), replaced under the
#   lock; the engine thread wakes the consumer with call_soon_threadsafe(event.set) on its loop, so
#   the asyncio.Event is only touched there. A slow reader gets outputs coalesced; the final one
#   (or an exception) is always the last it sees, since nothing is put after it.
# * Adds are applied before aborts, so a request added and abandoned within one iteration is
#   added, then aborted (its blocks freed), never left running with no one to read it.
# * A sink is removed in exactly one place per request: on its final output (_deliver) or by
#   abort(). After that nothing is delivered to it, and a late abort() is a no-op.
# * Admission (tokenizing, the admission rule) runs on the caller's side, so a bad request fails
#   in its handler without waiting for a step; what is queued can only fail for an engine-internal
#   reason, which comes back as an exception item (RequestFailedError for one request).
# * Death: if the engine thread's loop raises, it sets `error`, takes every sink and clears _adds
#   under the lock, then hands each sink EngineDeadError. generate() registers under the same lock
#   after checking `error`, so a request either was registered before (and is answered by the
#   sweep) or sees `error` and raises: none waits forever.
# * Shutdown: shutdown() sets _stopping and notifies; the thread returns at its next check (after
#   the step in progress) and the loop awaits the join in an executor. The server drains first
#   (server/cli.py), so normally nothing is in flight by then.
# An engine core in its own process would keep this shape: the sinks stay here, adds and aborts
# become messages to it, and a task on the loop reads its outputs and does what _deliver does.


class QueueFullError(RuntimeError):
    """More requests are waiting than the server admits; retry later."""


def check_queue_room(in_flight: int, stats: dict, max_num_seqs: int, max_waiting: int | None) -> None:
    """QueueFullError when max_waiting requests already wait. Requests in flight that will not be in the
    running batch count as waiting: those beyond what runs now, or beyond max_num_seqs (a burst arrives
    before the engine has admitted anyone). Shared by every engine client."""
    running = max(stats.get("num_running", 0), min(in_flight, max_num_seqs))
    waiting = in_flight - running
    if max_waiting is not None and waiting >= max_waiting:
        raise QueueFullError(f"{waiting} requests are already waiting (limit {max_waiting})")


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


class _Sink:
    """Where the engine thread leaves one request's outputs for its consumer.

    Only the latest output waits: each one holds everything before it (all tokens, all text), so a reader
    slower than the engine gets the outputs coalesced, and a stalled one costs one output's memory, not
    one per step. put() runs under the engine's lock; the event is only touched on the consumer's loop."""

    __slots__ = ("loop", "event", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.event = asyncio.Event()
        self.pending: dict = {}
        """The latest output of each of the request's n sequences (by index); an exception under -1."""

    def put(self, item) -> None:
        was_empty = not self.pending
        self.pending[item.index if isinstance(item, RequestOutput) else -1] = item
        if was_empty:
            self.loop.call_soon_threadsafe(self.event.set)


@dataclass
class _Add:
    """One admitted request on its way from the event loop to the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    weight: float
    priority: int
    arrival_time: float
    cache_salt: str | None


class AsyncEngine:
    """The EngineClient (runtime/engine_client.py) over an Engine in this process."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._max_num_seqs = engine.config.scheduler.max_num_seqs
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._sinks: dict[str, _Sink] = {}
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

    # ---- what the server may read: fixed when the engine was built ----------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """For chat templates, /tokenize and /detokenize; encode/decode are safe from any thread."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine thread has stopped on an error."""
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an internal error")

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (waiting, running, or about to be handed over)."""
        with self._lock:
            return len(self._sinks)

    def stats(self) -> dict:
        """The engine's stats as of its last step (safe to call from any thread)."""
        with self._lock:
            return dict(self._stats)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
        clamp_max_tokens: bool = False,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield snapshots of the request's output as tokens arrive; the last one has finished=True.

        The request is admitted here, before anything is queued: InvalidRequestError (naming the
        field) if it can never run, QueueFullError if too many wait. params.max_tokens None asks
        for all the room there is; clamp_max_tokens: max_tokens is a default, lowered to what fits;
        cache_salt: the prefix-cache namespace (default: the tenant's own). With params.n > 1 the
        snapshots of its n sequences interleave (RequestOutput.index tells which), and the stream
        ends when all n have finished."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        sink = _Sink(loop)
        arrival = time.monotonic()
        ids, params = self.engine.admit(prompt, params, clamp_max_tokens=clamp_max_tokens)
        if not weight > 0:
            raise InvalidRequestError("weight", f"must be positive, got {weight!r}")
        with self._lock:
            if self.error is not None:  # it died since the check above: never queue into a dead engine
                raise EngineDeadError("the engine stopped after an internal error")
            check_queue_room(len(self._sinks), self._stats, self._max_num_seqs, self.max_waiting)
            if request_id in self._sinks:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._sinks[request_id] = sink
            self._adds.append(_Add(request_id, ids, params, tenant, weight, priority, arrival, cache_salt))
            self._wake.notify()
        finished = False
        remaining = params.n  # sequences still running; the last one to finish ends the stream
        try:
            while True:
                with self._lock:
                    items, sink.pending = sink.pending, {}
                    if not items:
                        sink.event.clear()
                if not items:
                    await sink.event.wait()
                    continue
                if -1 in items:
                    finished = True
                    raise items[-1]
                for item in items.values():
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
            for sink in sinks.values():
                sink.put(RequestAbortedError(reason))
        return len(sinks)

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.abort_all("the engine has shut down")  # nobody may wait on a stopped engine

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._lock:
                    while not (
                        self._stopping or self._adds or self._aborts or engine.has_unfinished_requests()
                    ):
                        self._wake.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                # Adds first: a request added and abandoned during the same step must be added, then aborted.
                for add in adds:
                    self._unfinished[add.request_id] = add.params.n
                    try:
                        engine.enqueue(
                            add.request_id,
                            add.prompt_ids,
                            add.params,
                            tenant=add.tenant,
                            weight=add.weight,
                            priority=add.priority,
                            arrival_time=add.arrival_time,
                            cache_salt=add.cache_salt,
                        )
                    except ValueError as exc:
                        self._unfinished.pop(add.request_id, None)
                        self._deliver(add.request_id, exc, final=True)
                    except Exception as exc:  # a bug adding this one request: fail it, not the engine
                        log.exception("adding request %s failed", add.request_id)
                        engine.abort_request(add.request_id)
                        self._unfinished.pop(add.request_id, None)
                        self._deliver(
                            add.request_id,
                            RequestFailedError(
                                RequestOutput(
                                    add.request_id,
                                    list(add.prompt_ids),
                                    [],
                                    "",
                                    True,
                                    "abort",
                                    arrival_time=add.arrival_time,
                                    error=f"{type(exc).__name__} while adding the request",
                                )
                            ),
                            final=True,
                        )
                for request_id in aborts:
                    engine.abort_request(request_id)
                    self._unfinished.pop(request_id, None)
                outputs = engine.step() if engine.has_unfinished_requests() else []
                stats = engine.stats()
                with self._lock:
                    self._stats = stats
                for out in outputs:
                    final = out.error is not None  # a failed request ends at once, all its sequences with it
                    if out.finished and not final:  # the last of a request's n sequences ends its stream
                        left = self._unfinished.get(out.request_id, 1) - 1
                        self._unfinished[out.request_id] = left
                        final = left <= 0
                    if final:
                        self._unfinished.pop(out.request_id, None)
                    self._deliver(out.request_id, out, final=final)
        except BaseException as exc:  # keep serving errors visible instead of hanging clients
            log.exception("engine thread failed")
            with self._lock:  # with the error set under the lock, no request can slip in after the sweep
                self.error = exc
                sinks, self._sinks = self._sinks, {}
                self._adds.clear()
                for sink in sinks.values():
                    sink.put(EngineDeadError("the engine failed"))

    def _deliver(self, request_id: str, item, final: bool) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None) if final else self._sinks.get(request_id)
            if sink is not None:
                sink.put(item)
