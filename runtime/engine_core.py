"""The engine core: the step loop as the main thread of a process of its own.

Why a process. Served from a thread of the HTTP process, the engine shares one
GIL with tokenization, JSON and SSE, and its OpenMP thread team belongs to a
non-main thread (measured 1.5x slower on an Intel Xeon). Here the step loop is
the core process's main thread, and the server process keeps HTTP,
tokenization and the hand-off (runtime/engine_core_client.py), as vLLM v1 does.

Protocol. Two one-way multiprocessing pipes; every message is a pickled tuple.

    server process (EngineCoreClient)                    core process (run_engine_core)
    ---------------------------------                    ------------------------------
                                          <- requests -  ("ready", CoreInfo)      model loaded
                                                         ("failed", text, kind)   could not load; it exits
    ("add", request_id, ids, params, options)           ->  options: Engine.add_request's keywords
    ("abort", request_id)                                ->
    ("stop",)                                            ->  exits after the step it is in
                                          <- outputs -   ("step", [OutputDelta, ...], rejected, stats)
                                                         one per loop iteration that did anything;
                                                         rejected: [(request_id, ValueError text)]
                                                         ("dead", text)  the loop itself failed; it exits

The engine's own deltas (runtime/outputs.py) go over the pipe as they are:
each carries only what is new for its sequence (tokens, text, times,
logprobs), so a step costs the same whatever the outputs' lengths.
Messages are read between steps, in order, so an add followed by its abort is
added, then aborted. The core dies with the server: prctl(PR_SET_PDEATHSIG)
where Linux has it, and in any case an end-of-file on the requests pipe or a
changed parent pid, checked at least once a second, ends it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from runtime.engine import Engine
from runtime.outputs import OutputDelta
from runtime.tokenizer import Tokenizer

log = logging.getLogger("prescient.engine_core")

IDLE_POLL_SECONDS = 1.0
"""While idle the core waits this long for a message before checking that its parent lives."""


@dataclass
class CoreInfo:
    """What the server process needs to know about the loaded engine (sent once, with "ready")."""

    tokenizer: Tokenizer
    admission: object
    """The engine's AdmissionRule: the client admits requests with it on the server's side."""
    description: str
    model_name: str
    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    stats: dict


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
        engine = Engine.from_pretrained(**settings)
    except BaseException as exc:  # report why, so the server can exit with the message instead of hanging
        outputs.send(("failed", str(exc), type(exc).__name__))
        return
    config = engine.scheduler.config
    outputs.send(
        (
            "ready",
            CoreInfo(
                tokenizer=engine.tokenizer,
                admission=engine.admission,
                description=engine.describe(),
                model_name=engine.model_name,
                max_model_len=engine.max_model_len,
                kv_capacity_tokens=engine.admission.kv_capacity_tokens,
                vocab_size=engine.model.config.vocab_size,
                max_num_seqs=config.max_num_seqs,
                num_blocks=engine.kv.num_blocks,
                block_size=engine.kv.block_size,
                dtype=str(engine.model.dtype).removeprefix("torch."),
                device=str(engine.model.device),
                stats=engine.stats(),
            ),
        )
    )
    try:
        _CoreLoop(engine, requests, outputs, parent_pid).run()
    except BaseException as exc:
        log.exception("engine core failed")
        try:
            outputs.send(("dead", f"{type(exc).__name__} in the engine core"))
        except OSError:
            pass


class _CoreLoop:
    def __init__(self, engine, requests: Connection, outputs: Connection, parent_pid: int):
        self.engine = engine
        self.requests = requests
        self.outputs = outputs
        self.parent_pid = parent_pid

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not self.requests.poll(0 if busy else IDLE_POLL_SECONDS) and not busy:
                if os.getppid() != self.parent_pid:
                    return
                continue
            deltas: list[OutputDelta] = []
            rejected: list[tuple[str, str]] = []
            while self.requests.poll(0):
                try:
                    message = self.requests.recv()
                except EOFError:  # the server closed its end (or died): nothing more will come
                    return
                if message[0] == "stop":
                    return
                self._handle(message, deltas, rejected)
            if engine.has_unfinished_requests():
                deltas += engine.step()
            self.outputs.send(("step", deltas, rejected, engine.stats()))

    def _handle(self, message: tuple, deltas: list[OutputDelta], rejected: list[tuple[str, str]]) -> None:
        kind, request_id = message[0], message[1]
        if kind == "abort":
            self.engine.abort_request(request_id)
            return
        _, request_id, ids, params, options = message
        try:
            self.engine.enqueue(request_id, ids, params, **options)
        except ValueError as exc:
            rejected.append((request_id, str(exc)))
        except Exception as exc:  # a bug adding this one request: fail it, not the engine
            log.exception("adding request %s failed", request_id)
            self.engine.abort_request(request_id)
            error = f"{type(exc).__name__} while adding the request"
            deltas.append(OutputDelta(request_id, finished=True, finish_reason="abort", error=error))


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
