"""The engine core: the loop that owns an Engine, applies the clients' messages and steps.

One loop, two transports. run_core_loop reads AddRequest / Abort / Stop
(runtime/engine/messages.py) from a `receive` function, applies them in order
(so an add followed by its abort is added, then aborted), steps the engine and
hands each iteration's StepOutput to an `emit` function. AsyncEngine runs it on
a thread with a queue and a direct call; run_engine_core runs it as the main
thread of a process of its own, over two pipes.

Why a process. Served from a thread of the HTTP process, the engine shares one
GIL with tokenization, JSON and SSE, and its OpenMP thread team belongs to a
non-main thread, which runs the same steps slower (`python -m tests.bench serve`: the thread
server against the core process). As the core process's
main thread the step loop has neither problem, and the server process keeps
HTTP, tokenization and the hand-off (runtime/engine/core_client.py), as vLLM v1
does.

Process protocol. Two one-way multiprocessing pipes, every message a pickled
frozen dataclass:

    server process (EngineCoreClient)              core process (run_engine_core)
    <- outputs -  CoreInfo                         model loaded, ready
                  CoreFailed                       could not load; it exits
    AddRequest, Abort, Stop  -> requests ->        applied between steps, in order
    <- outputs -  StepOutput                       one per loop iteration that did anything
                  CoreDead                         the loop itself failed; it exits

The core dies with the server: prctl(PR_SET_PDEATHSIG) where Linux has it,
and in any case an end-of-file on the requests pipe or a changed parent pid,
checked at least once a second, ends it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from runtime.engine.messages import Abort, AddRequest, CoreDead, CoreFailed, Rejected, StepOutput
from runtime.engine.outputs import OutputDelta
from runtime.engine.request_checks import RequestChecks
from scheduler import SchedulerStats

if TYPE_CHECKING:  # the core process loads it; the server's front end, which starts the core, does not
    from runtime.engine.engine import Engine

log = logging.getLogger("prescient.engine_core")

IDLE_POLL_SECONDS = 1.0
"""While idle the core waits this long for a message before checking that its parent lives."""


@dataclass(frozen=True)
class CoreInfo:
    """What the server process needs to know about the loaded engine (sent once, when it is ready)."""

    checks: RequestChecks
    """The engine's request checks (its tokenizer and admission rule): the client runs them."""
    description: str
    model_name: str
    max_num_seqs: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    stats: SchedulerStats


def run_engine_core(
    requests: Connection, outputs: Connection, settings: dict, parent_pid: int, log_level: str = "INFO"
) -> None:
    """The core process's entry point: load the engine, say ready, run the loop until stopped."""
    _die_with_parent()
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s",
    )
    try:
        from runtime.engine.engine import Engine

        engine = Engine.from_pretrained(**settings)
    except BaseException as exc:  # report why, so the server can exit with the message instead of hanging
        outputs.send(CoreFailed(str(exc), type(exc).__name__))
        return
    config = engine.scheduler.config
    outputs.send(
        CoreInfo(
            checks=engine.checks,
            description=engine.describe(),
            model_name=engine.model_name,
            max_num_seqs=config.max_num_seqs,
            num_blocks=engine.kv.num_blocks,
            block_size=engine.kv.block_size,
            dtype=str(engine.model.dtype).removeprefix("torch."),
            device=str(engine.model.device),
            stats=engine.stats(),
        )
    )
    try:
        run_core_loop(engine, _pipe_receiver(requests), outputs.send, lambda: os.getppid() == parent_pid)
    except BaseException as exc:
        log.exception("engine core failed")
        try:
            outputs.send(CoreDead(f"{type(exc).__name__} in the engine core"))
        except OSError:
            pass


def run_core_loop(
    engine: Engine,
    receive: Callable[[float | None], list | None],
    emit: Callable[[StepOutput], None],
    still_wanted: Callable[[], bool] | None = None,
) -> None:
    """Apply messages and step until Stop, the end of the messages, or (idle) still_wanted() is False.

    receive(timeout): the messages sent so far, in order, waiting up to timeout seconds for the first
    (None: until one comes) and returning [] if none came, None if the sender closed its end.
    emit: one StepOutput per iteration that did anything. still_wanted: asked every IDLE_POLL_SECONDS
    while idle; without it an idle loop sleeps until a message comes."""
    idle_wait = None if still_wanted is None else IDLE_POLL_SECONDS
    while True:
        busy = engine.has_unfinished_requests()
        messages = receive(0 if busy else idle_wait)
        if messages is None:
            return
        if not messages and not busy:
            if still_wanted is not None and not still_wanted():
                return
            continue
        deltas: list[OutputDelta] = []
        rejected: list[Rejected] = []
        for message in messages:
            if type(message) is Abort:
                engine.abort_request(message.request_id)
            elif type(message) is AddRequest:
                _add(engine, message, deltas, rejected)
            else:  # Stop
                return
        if engine.has_unfinished_requests():
            deltas += engine.step()
        emit(StepOutput(deltas, rejected, engine.stats()))


def _add(engine: Engine, add: AddRequest, deltas: list[OutputDelta], rejected: list[Rejected]) -> None:
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
        rejected.append(Rejected.of(add.request_id, exc))
    except Exception as exc:  # a bug adding this one request: fail it, not the engine
        log.exception("adding request %s failed", add.request_id)
        engine.abort_request(add.request_id)
        error = f"{type(exc).__name__} while adding the request"
        deltas.append(
            OutputDelta(
                add.request_id,
                finished=True,
                finish_reason="abort",
                arrival_time=add.arrival_time,
                error=error,
            )
        )


def _pipe_receiver(conn: Connection) -> Callable[[float], list | None]:
    def receive(timeout: float) -> list | None:
        if not conn.poll(timeout):
            return []
        messages = []
        while True:
            try:
                messages.append(conn.recv())
            except EOFError:  # the server closed its end (or died): nothing more will come
                return None
            if not conn.poll(0):
                return messages

    return receive


def queue_receiver(inbox: queue.SimpleQueue) -> Callable[[float | None], list | None]:
    """receive() over a queue between threads of one process."""

    def receive(timeout: float | None) -> list | None:
        if timeout == 0 and inbox.empty():
            return []
        try:
            messages = [inbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not inbox.empty():
            messages.append(inbox.get_nowait())
        return messages

    return receive


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits (no orphan cores)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the pipe's end-of-file and the parent-pid check still end the core
