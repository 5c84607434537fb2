"""AsyncEngine: the engine client over an Engine on a thread of this process, for an asyncio event loop.

The event loop never runs the model. The engine thread runs the core loop
(runtime/engine/core.py, run_core_loop) over a queue: the client half
(runtime/engine/client.py) admits a request on the caller's side and puts
its AddRequest in the queue; the loop applies what it finds between steps and
hands each StepOutput straight to the client half, which puts the deltas in
their streams and wakes their readers with call_soon_threadsafe. A consumer
that stops iterating (client gone, task cancelled) aborts its request at
once, which frees its KV blocks. EngineCoreClient is the same with the loop in
a process of its own and pipes for the queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from runtime.engine.client import EngineClient
from runtime.engine.core import queue_receiver, run_core_loop
from runtime.engine.engine import Engine
from runtime.engine.messages import Stop

log = logging.getLogger("prescient.engine")


class AsyncEngine(EngineClient):
    """The EngineClient (runtime/engine/client.py) over an Engine in this process."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        super().__init__(engine.checks, engine.stats(), engine.config.scheduler.max_num_seqs, max_waiting)
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _send(self, message) -> None:
        self._inbox.put(message)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prescient-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop (after the step in progress) and fail whatever is still in flight."""
        self._send(Stop())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.abort_all("the engine has shut down")  # nobody may wait on a stopped engine

    def _run(self) -> None:
        try:
            run_core_loop(self.engine, queue_receiver(self._inbox), self._on_step)
        except BaseException as exc:  # keep serving errors visible instead of hanging clients
            log.exception("engine thread failed")
            self._died(exc)
