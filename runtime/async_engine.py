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
from runtime.errors import EngineDeadError, QueueFullError, RequestAbortedError
from runtime.output_stream import OutputStream
from runtime.outputs import OutputDelta
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
#   _sinks   {request_id: OutputStream}  where a request's deltas go (runtime/output_stream.py);
#            present exactly while the request is in flight (num_in_flight = len(_sinks))
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
#                                                     deltas = engine.step()         (no lock held)
#                                                     lock: _stats = engine.stats()
#   sink.deltas() <------ sink.put(delta) ----------  for each delta: lock: look up its sink, put
#     yield what came since the last read,              (pop the sink if the delta ends the request)
#       coalesced; the request's last one -> return
#     a failed delta or sink.fail(exc) -> raise
#   leaving early (break, cancel, the client
#     went away) -> abort(): lock: pop the sink,
#     append to _aborts, notify ------------------->  (removed at the next iteration)
#
# Why it holds:
# * A step hands over only what is new (OutputDelta), so its cost does not grow with the outputs'
#   lengths. A sink keeps the deltas its reader has not taken and gives them out coalesced, so a
#   slow reader loses and repeats nothing; the final delta (or an exception) is the last it sees,
#   since nothing is put after it. The engine thread wakes the reader with call_soon_threadsafe, so
#   the asyncio.Event is only touched on the loop.
# * Adds are applied before aborts, so a request added and abandoned within one iteration is
#   added, then aborted (its blocks freed), never left running with no one to read it.
# * A sink is removed in exactly one place per request: with the delta that ends it (_deliver),
#   by abort() or abort_all(), or by the death sweep. After that nothing is delivered to it, and a
#   late abort() is a no-op.
# * Admission (tokenizing, the admission rule) runs on the caller's side, so a bad request fails
#   in its handler without waiting for a step; what is queued can only fail for an engine-internal
#   reason, which comes back as a delta with `error` (RequestFailedError for one request).
# * Death: if the engine thread's loop raises, it sets `error`, takes every sink and clears _adds
#   under the lock, then fails each sink with EngineDeadError. generate() registers under the same
#   lock after checking `error`, so a request either was registered before (and is answered by the
#   sweep) or sees `error` and raises: none waits forever.
# * Shutdown: shutdown() sets _stopping and notifies; the thread returns at its next check (after
#   the step in progress) and the loop awaits the join in an executor. The server drains first
#   (server/cli.py), so normally nothing is in flight by then.
# The engine core in its own process (runtime/engine_core_client.py) keeps this shape: the sinks
# stay in the server's process, adds and aborts are messages to the core, and the loop reads its
# deltas and puts them as _deliver does.


def check_queue_room(in_flight: int, stats: dict, max_num_seqs: int, max_waiting: int | None) -> None:
    """QueueFullError when max_waiting requests already wait. Requests in flight that will not be in the
    running batch count as waiting: those beyond what runs now, or beyond max_num_seqs (a burst arrives
    before the engine has admitted anyone). Shared by every engine client."""
    running = max(stats.get("num_running", 0), min(in_flight, max_num_seqs))
    waiting = in_flight - running
    if max_waiting is not None and waiting >= max_waiting:
        raise QueueFullError(f"{waiting} requests are already waiting (limit {max_waiting})")


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
        self._sinks: dict[str, OutputStream] = {}
        self._stats: dict = engine.stats()
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
    ) -> AsyncIterator[OutputDelta]:
        """Yield what is new in the request's output as tokens arrive; the last delta has finished=True.

        The request is admitted here, before anything is queued: InvalidRequestError (naming the
        field) if it can never run, QueueFullError if too many wait. params.max_tokens None asks
        for all the room there is; clamp_max_tokens: max_tokens is a default, lowered to what fits;
        cache_salt: the prefix-cache namespace (default: the tenant's own). With params.n > 1 the
        deltas of its n sequences interleave (OutputDelta.index tells which), and the stream
        ends when all n have finished. A reader slower than the engine gets several steps in one delta."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        ids, params = self.engine.admit(prompt, params, clamp_max_tokens=clamp_max_tokens)
        if not weight > 0:
            raise InvalidRequestError("weight", f"must be positive, got {weight!r}")
        sink = OutputStream(loop, params.n)
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
        try:
            async for delta in sink.deltas(params.n):
                yield delta
            finished = True
        finally:
            if not finished:  # the reader left early (or the request failed: then this is a no-op)
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
            sink.fail(RequestAbortedError(reason))
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
                        self._fail_one(add.request_id, exc)
                    except Exception as exc:  # a bug adding this one request: fail it, not the engine
                        log.exception("adding request %s failed", add.request_id)
                        engine.abort_request(add.request_id)
                        self._deliver(
                            OutputDelta(
                                add.request_id,
                                finished=True,
                                finish_reason="abort",
                                arrival_time=add.arrival_time,
                                error=f"{type(exc).__name__} while adding the request",
                            )
                        )
                for request_id in aborts:
                    engine.abort_request(request_id)
                outputs = engine.step() if engine.has_unfinished_requests() else []
                stats = engine.stats()
                with self._lock:
                    self._stats = stats
                for delta in outputs:
                    self._deliver(delta)
        except BaseException as exc:  # keep serving errors visible instead of hanging clients
            log.exception("engine thread failed")
            with self._lock:  # with the error set under the lock, no request can slip in after the sweep
                self.error = exc
                sinks, self._sinks = self._sinks, {}
                self._adds.clear()
            for sink in sinks.values():
                sink.fail(EngineDeadError("the engine failed"))

    def _deliver(self, delta: OutputDelta) -> None:
        """Hand a delta to its request's stream; the one that ends the request removes the stream."""
        with self._lock:
            sink = self._sinks.get(delta.request_id)
            if sink is not None and sink.put(delta):
                del self._sinks[delta.request_id]

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.fail(error)
