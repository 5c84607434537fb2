"""The server's side of an engine core in its own process (runtime/engine_core.py has the protocol).

It offers what AsyncEngine offers (generate, abort, stats, num_in_flight,
start, shutdown, error) plus what the server asks of the engine itself
(tokenizer, max_model_len, kv_capacity_tokens, vocab_size, check_request),
so the server cannot tell which one it talks to. Tokenization and request
checks run here; the core only steps.

Hand-off. Adds and aborts go through a queue to one sender thread, so a full
pipe (the core busy in a long step) never blocks the event loop. The core's
outputs are read on the event loop itself (loop.add_reader), one message per
step for all requests; each delta is put in its request's OutputStream, as
the thread engine does, so a consumer slower than the engine gets one delta
carrying every token since its last read.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from runtime.async_engine import check_queue_room
from runtime.engine_core import CoreInfo, run_engine_core
from runtime.errors import EngineDeadError, RequestAbortedError
from runtime.output_stream import OutputStream
from runtime.outputs import OutputDelta
from runtime.structured_output import check_structured_output
from scheduler import InvalidRequestError, SamplingParams

log = logging.getLogger("prescient.engine")

STARTUP_TIMEOUT_SECONDS = 600.0
"""Longest wait for the core to load its model and say ready."""
STOP_TIMEOUT_SECONDS = 10.0
"""After asking the core to stop, wait this long before killing it."""
CORE_GOMP_SPINCOUNT = "10000"
"""How long the core's OpenMP threads spin before sleeping, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set:
10,000 pauses, ~0.26 ms on a 2-core AMD EPYC (26 ns a pause). libgomp's default (300,000, ~8 ms) is for a team
that owns its cores; a team on a host whose CPUs are oversubscribed (other engines, other work) spins away the
others' time slices: there one stream decoded at 0.3-0.9 tok/s with the default, 4-6 with 1,000 or 0. Too
short a spin costs the other way: with the server's event loop and its clients on the same cores, a thread
that slept mid-step waits for its core back, and 32 streams over HTTP ran their decode steps slower than the
offline engine's at 1,000 spins: 0.78-0.96x the offline rate (median 0.88, 18 rounds) against 0.83-1.09x
(median 0.94, 29 rounds) at 10,000, alternating. On an oversubscribed host 10,000 costs ~10% over 1,000 (four
server test files under two pytest workers: 82-90 s against 71-79 s)."""


class EngineCoreClient:
    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        requests,
        outputs,
        info: CoreInfo,
        max_waiting: int | None = None,
    ):
        self._process = process
        self._requests = requests
        self._outputs = outputs
        self.info = info
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.kv_capacity_tokens = info.kv_capacity_tokens
        self.vocab_size = info.vocab_size
        self.max_waiting = max_waiting
        self._stats = dict(info.stats)
        self._streams: dict[str, OutputStream] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @classmethod
    def launch(
        cls,
        settings: dict,
        *,
        max_waiting: int | None = None,
        log_level: str = "INFO",
        startup_timeout: float = STARTUP_TIMEOUT_SECONDS,
    ) -> EngineCoreClient:
        """Start a core process with Engine.from_pretrained(**settings) and wait until it is ready.
        A core that cannot load raises here: ValueError for a bad setting or path, RuntimeError otherwise."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that has torch threads running
        requests_read, requests_write = ctx.Pipe(duplex=False)
        outputs_read, outputs_write = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=run_engine_core,
            name="prescient-engine-core",
            daemon=True,
            args=(requests_read, outputs_write, settings, os.getpid(), log_level),
        )
        spin = None if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ) else CORE_GOMP_SPINCOUNT
        if spin is not None:  # the spawned core reads its environment when torch loads libgomp
            os.environ["GOMP_SPINCOUNT"] = spin
        try:
            process.start()
        finally:
            if spin is not None:
                del os.environ["GOMP_SPINCOUNT"]
        requests_read.close()
        outputs_write.close()
        deadline = time.monotonic() + startup_timeout
        try:
            while not outputs_read.poll(0.1):
                if not process.is_alive():
                    raise RuntimeError(f"the engine core exited with code {process.exitcode} while loading")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core was not ready within {startup_timeout:.0f} s")
            message = outputs_read.recv()
        except BaseException:
            _stop_process(process, 0)
            raise
        if message[0] == "failed":
            _stop_process(process, STOP_TIMEOUT_SECONDS)
            raise (ValueError if message[2] == "ValueError" else RuntimeError)(message[1])
        return cls(process, requests_write, outputs_read, message[1], max_waiting)

    # ---- what the server asks of the engine ---------------------------------------------------

    def admit(
        self, prompt: str | list[int], params: SamplingParams, *, clamp_max_tokens: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and params with max_tokens resolved, or InvalidRequestError naming the field
        (the engine's own rule, Engine.admit, run here on the server's side)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidRequestError(
                        "prompt", f"token {i} is {t!r}, not a token id in [0, {self.vocab_size})"
                    )
        else:
            raise InvalidRequestError(
                "prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        check_structured_output(params.structured_output)
        max_tokens = self.info.admission.admit(len(ids), params.max_tokens, clamp=clamp_max_tokens)
        if max_tokens != params.max_tokens:
            params = replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        return ids, params

    def check_health(self) -> None:
        """Raise EngineDeadError if the core has died."""
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an internal error")

    # ---- the AsyncEngine interface ---------------------------------------------------------------

    def start(self) -> None:
        """Begin reading the core's outputs on the running event loop."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._outputs.fileno(), self._on_outputs)
        self._sender = threading.Thread(target=self._send_loop, name="prescient-core-sender", daemon=True)
        self._sender.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def stats(self) -> dict:
        """The engine's stats as of its last step."""
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
        """Yield what is new in the request's output as tokens arrive; the last delta has finished=True
        (AsyncEngine.generate says the rest)."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        ids, params = self.admit(prompt, params, clamp_max_tokens=clamp_max_tokens)
        if not weight > 0:
            raise InvalidRequestError("weight", f"must be positive, got {weight!r}")
        check_queue_room(len(self._streams), self._stats, self.info.max_num_seqs, self.max_waiting)
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        stream = self._streams[request_id] = OutputStream(asyncio.get_running_loop(), params.n)
        options = dict(
            tenant=tenant, weight=weight, priority=priority, arrival_time=arrival, cache_salt=cache_salt
        )
        self._outbox.put(("add", request_id, ids, params, options))
        finished = False
        try:
            async for delta in stream.deltas(params.n):
                yield delta
            finished = True
        finally:
            if not finished:  # the reader left early (or the request failed: then this is a no-op)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self.error is None:
            self._outbox.put(("abort", request_id))

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight now: each consumer gets RequestAbortedError(reason) and the core
        frees their blocks. Returns how many there were."""
        if self.error is None:
            for request_id in self._streams:
                self._outbox.put(("abort", request_id))
        return self._fail_all(RequestAbortedError(reason))

    async def shutdown(self) -> None:
        """Stop the core (it finishes the step it is in) and wait for it; kill it if it does not stop."""
        if self._loop is not None:
            self._loop.remove_reader(self._outputs.fileno())
        self._outbox.put(("stop",))
        self._outbox.put(None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _stop_process, self._process, STOP_TIMEOUT_SECONDS)
        if self._sender is not None:
            self._sender.join(timeout=STOP_TIMEOUT_SECONDS)
        self._fail_all(RequestAbortedError("the engine has shut down"))
        self._requests.close()
        self._outputs.close()

    # ---- the hand-off --------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._requests.send(message)
            except OSError:  # the core is gone; the reader reports it
                return

    def _on_outputs(self) -> None:
        """One message a call: the reader is level-triggered, so the loop calls again while more are waiting
        (Connection.poll() would build a selector on every call, twice a message)."""
        try:
            message = self._outputs.recv()
            if message[0] == "step":
                _, deltas, rejected, self._stats = message
                for request_id, reason in rejected:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.fail(ValueError(reason))
                for delta in deltas:
                    stream = self._streams.get(delta.request_id)
                    if stream is not None and stream.put(delta):  # None: aborted by its consumer
                        del self._streams[delta.request_id]
            else:  # "dead"
                self._core_died(f"the engine core failed: {message[1]}")
        except (EOFError, OSError):
            self._core_died(f"the engine core exited (code {self._process.exitcode})")

    def _core_died(self, reason: str) -> None:
        if self.error is None:
            log.error("%s; failing %d requests in flight", reason, len(self._streams))
            self.error = EngineDeadError(reason)
        if self._loop is not None:
            self._loop.remove_reader(self._outputs.fileno())
        self._outbox.put(None)
        self._fail_all(EngineDeadError("the engine stopped after an internal error"))

    def _fail_all(self, error: BaseException) -> int:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
        return len(streams)


def _stop_process(process, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
