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
                                          <- outputs -   ("step", [Delta, ...], stats)
                                                         one per loop iteration that did anything
                                                         ("dead", text)  the loop itself failed; it exits

A Delta carries only what is new since the last one for one sequence of a
request (tokens, text, their times and logprobs; the prompt's logprobs once),
so a step costs the same whatever the outputs' lengths. A request with n > 1
has n sequences, told apart by Delta.index; each ends with its own finished
delta.
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
from runtime.logprobs import TokenLogprob
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


@dataclass
class Delta:
    """What a step added to one request's output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_time: float | None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    """Set when the request failed: a ValueError's text on admission, or the engine's RequestOutput.error."""
    rejected: bool = False
    """The request was refused on admission (error is then the ValueError's message)."""
    index: int = 0
    """Which of the request's n sequences this is (RequestOutput.index)."""
    new_logprobs: list[TokenLogprob] | None = None
    """The logprobs of new_token_ids, when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt's logprobs (echo), sent once: with the sequence's first delta that has them."""


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
        self._sent: dict[tuple[str, int], tuple[int, int, bool]] = {}
        """(request id, sequence index) -> (tokens, characters of text, prompt logprobs?) already sent."""

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not self.requests.poll(0 if busy else IDLE_POLL_SECONDS) and not busy:
                if os.getppid() != self.parent_pid:
                    return
                continue
            deltas: list[Delta] = []
            while self.requests.poll(0):
                try:
                    message = self.requests.recv()
                except EOFError:  # the server closed its end (or died): nothing more will come
                    return
                if message[0] == "stop":
                    return
                self._handle(message, deltas)
            if engine.has_unfinished_requests():
                for out in engine.step():
                    deltas.append(self._delta(out))
            self.outputs.send(("step", deltas, engine.stats()))

    def _handle(self, message: tuple, deltas: list[Delta]) -> None:
        kind, request_id = message[0], message[1]
        if kind == "abort":
            self.engine.abort_request(request_id)
            for key in [key for key in self._sent if key[0] == request_id]:
                del self._sent[key]
            return
        _, request_id, ids, params, options = message
        try:
            self.engine.enqueue(request_id, ids, params, **options)
        except ValueError as exc:
            deltas.append(Delta(request_id, [], "", None, True, "abort", error=str(exc), rejected=True))
            return
        except Exception as exc:  # a bug adding this one request: fail it, not the engine
            log.exception("adding request %s failed", request_id)
            self.engine.abort_request(request_id)
            deltas.append(
                Delta(
                    request_id,
                    [],
                    "",
                    None,
                    True,
                    "abort",
                    error=f"{type(exc).__name__} while adding the request",
                )
            )
            return

    def _delta(self, out) -> Delta:
        key = (out.request_id, out.index)
        tokens, chars, prompt_sent = self._sent.pop(key, (0, 0, False))
        prompt = out.prompt_logprobs if not prompt_sent else None
        if not out.finished:
            self._sent[key] = (len(out.token_ids), len(out.text), prompt_sent or prompt is not None)
        return Delta(
            out.request_id,
            out.token_ids[tokens:],
            out.text[chars:],
            out.token_times[-1] if out.token_times else None,
            out.finished,
            out.finish_reason,
            out.stop_reason,
            out.num_cached_tokens,
            out.first_scheduled_time,
            out.first_token_time,
            out.finished_time,
            out.num_preemptions,
            out.error,
            index=out.index,
            new_logprobs=out.logprobs[tokens:] if out.logprobs is not None else None,
            prompt_logprobs=prompt,
        )


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
