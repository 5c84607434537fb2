"""EngineClient: everything the server may ask of the engine, and the half of it that lives beside the server.

The server holds one EngineClient and never reaches past it (no engine,
model, scheduler or KV cache); the surface is plain values (token ids,
SamplingParams, OutputDelta, SchedulerStats). The client admits requests on
the caller's side (runtime/engine/request_checks.py), keeps one OutputStream per
request in flight, sends AddRequest / Abort messages
(runtime/engine/messages.py) to the engine core, and puts each StepOutput's
deltas in their streams. AsyncEngine (the core on a thread, messages through
a queue) and EngineCoreClient (the core in a process, messages through
pipes) are this class plus their transport: `_send`, start, shutdown and
where StepOutputs come from. The server cannot tell which it holds.

Note [Engine client <-> engine core]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    caller (event loop)                      core loop (runtime/engine/core.py)
    -------------------                      ----------------------------------
    generate(): admit (tokenize, checks)     receive messages, in order: AddRequest, Abort, Stop
    lock: dead? -> EngineDeadError           engine.enqueue / engine.abort_request
          tenant over its share? -> 429      deltas = engine.step()
          register stream, _send(Add) --->   emit(StepOutput(deltas, rejected, stats))
    stream.deltas() <--- _on_step(StepOutput): lock: stats; each delta to its stream
    leaving early -> abort(): lock: drop the stream, _send(Abort)

Why it holds:
* One lock (`_lock`) guards the streams, the per-tenant counts, the stats and `error`; it is held only for
  dict operations, never while the model runs. _on_step runs on the core thread (thread mode) or on the
  event loop (process mode); either way it takes the lock.
* A stream is removed in exactly one place per request (_remove): with the delta that ends it, by
  abort() / abort_all(), by a rejection, or by the death sweep; nothing is delivered to it afterwards and a
  late abort() is a no-op.
* Messages reach the core in the order they were sent, so an add followed by its abort is added, then
  aborted: a request is never left running with no one to read it.
* Death: _died sets `error` and takes every stream under the lock, then fails them; generate() checks
  `error` and registers under the same lock, so a request is either answered by the sweep or raises.
* A step hands over only what is new (OutputDelta), and a stream coalesces what its reader has not taken,
  so a slow reader loses and repeats nothing and a step's cost does not grow with the outputs' lengths.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

from runtime.engine.errors import EngineDeadError, QueueFullError, RequestAbortedError
from runtime.engine.messages import Abort, AddRequest, StepOutput
from runtime.engine.output_stream import OutputStream
from runtime.engine.outputs import OutputDelta
from runtime.engine.request_checks import RequestChecks
from runtime.model.tokenizer import Tokenizer
from scheduler import InvalidRequestError, SamplingParams, SchedulerStats
from scheduler.waiting_share import waiting_refusal


class EngineClient:
    def __init__(
        self, checks: RequestChecks, stats: SchedulerStats, max_num_seqs: int, max_waiting: int | None
    ):
        self.checks = checks
        self.max_waiting = max_waiting
        self._max_num_seqs = max_num_seqs
        self._lock = threading.Lock()
        self._streams: dict[str, OutputStream] = {}
        self._tenant_in_flight: dict[str, int] = {}
        self._stats = stats
        self.error: BaseException | None = None

    def _send(self, message) -> None:
        """Hand a message to the core (the transport's part)."""
        raise NotImplementedError

    def start(self) -> None:
        """Start the engine loop (the app's startup)."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Stop the engine loop (the app's cleanup); whatever is still in flight fails."""
        raise NotImplementedError

    # ---- what the server may read -----------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """For chat templates, /tokenize and /detokenize; encode/decode are safe from any thread."""
        return self.checks.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""
        return self.checks.vocab_size

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens, the engine runs."""
        return self.checks.rule.max_model_len

    @property
    def model_card(self) -> dict:
        """The model's architecture, quantization and context length (GET /v1/models)."""
        return self.checks.model_card

    @property
    def kv_capacity_tokens(self) -> int:
        return self.checks.rule.kv_capacity_tokens

    def admit(
        self, prompt: str | list[int], params: SamplingParams, *, clamp_max_tokens: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and params with max_tokens resolved, or InvalidRequestError naming the field."""
        return self.checks.admit(prompt, params, clamp_max_tokens=clamp_max_tokens)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine can no longer serve."""
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an internal error")

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (waiting, running, or about to be handed over)."""
        with self._lock:
            return len(self._streams)

    def stats(self) -> SchedulerStats:
        """The engine's stats as of its last step (safe to call from any thread)."""
        return self._stats

    # ---- requests -----------------------------------------------------------------------------------

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
        field) if it can never run, QueueFullError if its tenant already has its share of the waiting
        queue (scheduler/waiting_share.py). params.max_tokens None asks for all the room there is;
        clamp_max_tokens: max_tokens is a default, lowered to what fits; cache_salt: the prefix-cache
        namespace (default: the tenant's own). With params.n > 1 the deltas of its n sequences
        interleave (OutputDelta.index tells which), and the stream ends when all n have finished. A
        reader slower than the engine gets several steps in one delta; the caller assembles what it needs
        (RequestOutput.append). Leaving the iteration early aborts the request."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        ids, params = self.checks.admit(prompt, params, weight=weight, clamp_max_tokens=clamp_max_tokens)
        stream = OutputStream(asyncio.get_running_loop(), params.n, tenant)
        with self._lock:
            if self.error is not None:  # it died since the check above: never queue into a dead engine
                raise EngineDeadError("the engine stopped after an internal error")
            self._check_queue_room(tenant)
            if request_id in self._streams:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._streams[request_id] = stream
            self._tenant_in_flight[tenant] = self._tenant_in_flight.get(tenant, 0) + 1
            self._send(AddRequest(request_id, ids, params, tenant, weight, priority, arrival, cache_salt))
        finished = False
        try:
            async for delta in stream.deltas(params.n):
                yield delta
            finished = True
        finally:
            if not finished:  # the reader left early (or the request failed: then this is a no-op)
                self.abort(request_id)

    def _check_queue_room(self, tenant: str) -> None:
        running = {t: s.running for t, s in self._stats.tenants.items()}
        refusal = waiting_refusal(
            self._tenant_in_flight, running, tenant, self._max_num_seqs, self.max_waiting
        )
        if refusal is not None:
            raise QueueFullError(refusal)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (no-op if unknown or finished)."""
        with self._lock:
            if self._remove(request_id) is not None and self.error is None:
                self._send(Abort(request_id))

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight now: each consumer gets RequestAbortedError(reason) and the
        engine frees their blocks. Returns how many there were."""
        with self._lock:
            streams = self._take_all()
            if self.error is None:
                for request_id in streams:
                    self._send(Abort(request_id))
        for stream in streams.values():
            stream.fail(RequestAbortedError(reason))
        return len(streams)

    # ---- what the core sends back -----------------------------------------------------------------------

    def _on_step(self, out: StepOutput) -> None:
        """Put a step's deltas in their streams; the delta that ends a request removes its stream."""
        failed = []
        with self._lock:
            self._stats = out.stats
            for rejected in out.rejected:
                stream = self._remove(rejected.request_id)
                if stream is not None:
                    failed.append((stream, rejected.error()))
            streams = self._streams
            for delta in out.deltas:
                stream = streams.get(delta.request_id)
                if stream is not None and stream.put(delta):  # None: aborted by its consumer
                    self._remove(delta.request_id)
        for stream, error in failed:
            stream.fail(error)

    def _died(self, error: BaseException) -> None:
        """The core stopped for good: fail every request in flight, and every one that comes later."""
        with self._lock:  # with the error set under the lock, no request can slip in after the sweep
            if self.error is None:
                self.error = error
            streams = self._take_all()
        for stream in streams.values():
            stream.fail(EngineDeadError("the engine stopped after an internal error"))

    def _remove(self, request_id: str) -> OutputStream | None:
        """Forget a request's stream (under the lock)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            left = self._tenant_in_flight[stream.tenant] - 1
            if left:
                self._tenant_in_flight[stream.tenant] = left
            else:
                del self._tenant_in_flight[stream.tenant]
        return stream

    def _take_all(self) -> dict[str, OutputStream]:
        """Forget every stream (under the lock)."""
        streams, self._streams = self._streams, {}
        self._tenant_in_flight.clear()
        return streams
