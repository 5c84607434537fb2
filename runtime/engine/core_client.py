"""The server's side of an engine core in its own process (runtime/engine/core.py has the protocol).

It is the client half every engine client shares (runtime/engine/client.py:
admission, streams, per-tenant queue shares) over two pipes, so the server
cannot tell it from AsyncEngine. Tokenization and request checks run here;
the core only steps.

Hand-off. Adds and aborts go through a queue to one sender thread, so a full
pipe (the core busy in a long step) never blocks the event loop. The core's
StepOutputs are read on the event loop itself (loop.add_reader), one message
per step for all requests.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import threading
import time

from runtime.engine.client import EngineClient
from runtime.engine.core import CoreInfo, run_engine_core
from runtime.engine.cpu_limits import cpu_limits
from runtime.engine.errors import EngineDeadError
from runtime.engine.messages import CoreFailed, StepOutput, Stop

log = logging.getLogger("prescient.engine")

STARTUP_TIMEOUT_SECONDS = 600.0
"""Longest wait for the core to load its model and say ready."""
STOP_TIMEOUT_SECONDS = 10.0
"""After asking the core to stop, wait this long before killing it."""
CORE_GOMP_SPINCOUNT = "300000"
"""How long the core's OpenMP threads spin before sleeping (a few milliseconds), unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set: libgomp's own default count, but set, not left to libgomp, which in the core spun
for less (measured: 32 streams over HTTP against the offline engine, tests/bench/bench_serve.py). Where
other processes share the cores the engine runs fewer threads (runtime/engine/cpu_share.py), and with one
thread none spins."""
QUOTA_GOMP_SPINCOUNT = "10000"
"""The spin under a CPU quota of fewer cores than threads, where CpuShare paces the thread count step by step
and a worker left out of a step would otherwise spend the quota spinning (a fraction of a millisecond)."""


def _spin_count() -> str:
    limits = cpu_limits()
    return (
        QUOTA_GOMP_SPINCOUNT
        if limits.quota is not None and limits.quota < limits.cores
        else CORE_GOMP_SPINCOUNT
    )


class EngineCoreClient(EngineClient):
    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        requests,
        outputs,
        info: CoreInfo,
        max_waiting: int | None = None,
    ):
        super().__init__(info.checks, info.stats, info.max_num_seqs, max_waiting)
        self._process = process
        self._requests = requests
        self._outputs = outputs
        self.info = info
        self.model_name = info.model_name
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
        spin = None if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ) else _spin_count()
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
        if isinstance(message, CoreFailed):
            _stop_process(process, STOP_TIMEOUT_SECONDS)
            raise (ValueError if message.kind == "ValueError" else RuntimeError)(message.message)
        return cls(process, requests_write, outputs_read, message, max_waiting)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _send(self, message) -> None:
        self._outbox.put(message)

    def start(self) -> None:
        """Begin reading the core's outputs on the running event loop."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._outputs.fileno(), self._on_outputs)
        self._sender = threading.Thread(target=self._send_loop, name="prescient-core-sender", daemon=True)
        self._sender.start()

    async def shutdown(self) -> None:
        """Stop the core (it finishes the step it is in) and wait for it; kill it if it does not stop."""
        if self._loop is not None:
            self._loop.remove_reader(self._outputs.fileno())
        self._outbox.put(Stop())
        self._outbox.put(None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _stop_process, self._process, STOP_TIMEOUT_SECONDS)
        if self._sender is not None:
            self._sender.join(timeout=STOP_TIMEOUT_SECONDS)
        self.abort_all("the engine has shut down")
        self._requests.close()
        self._outputs.close()

    # ---- the transport ---------------------------------------------------------------------------

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
        except (EOFError, OSError):
            self._core_died(f"the engine core exited (code {self._process.exitcode})")
            return
        if isinstance(message, StepOutput):
            self._on_step(message)
        else:  # CoreDead
            self._core_died(f"the engine core failed: {message.message}")

    def _core_died(self, reason: str) -> None:
        if self.error is None:
            log.error("%s; failing %d requests in flight", reason, self.num_in_flight)
        if self._loop is not None:
            self._loop.remove_reader(self._outputs.fileno())
        self._outbox.put(None)
        self._died(EngineDeadError(reason))


def _stop_process(process, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
