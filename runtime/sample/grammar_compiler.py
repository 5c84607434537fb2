"""Grammars compiled off the step: a request waits for its grammar while the others keep decoding.

Building an llguidance matcher for a large schema takes seconds (thousands of
`anyOf` branches; tests/runtime/test_grammar_wait.py shows the effect). Run inside
the engine step, that stalls every stream in the batch. (The first constrained
request also builds llguidance's tokenizer, on the same thread; that build holds
the GIL, about 0.4 s for a 49,152-token vocabulary, so the steps beside it wait
that once.) So the engine hands each new constrained request's
grammar to one compile thread (llguidance releases the GIL while it compiles)
and gives the request to the scheduler only once its matcher is built, as
vLLM's WAITING_FOR_FSM state does. The model runner then takes a copy of the
compiled matcher (LLMatcher.deep_copy, microseconds) instead of compiling
again; a grammar no longer held here is compiled where it is asked for.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance

from runtime.sample.structured_output import GrammarBackend
from scheduler import StructuredOutput

WAIT_SECONDS = 0.05
"""wait() returns after this long even if no compile finished (the engine then reads new messages)."""
COMPILED_GRAMMARS_KEPT = 32
"""Compiled matchers kept for reuse (least recently used dropped first): each new constrained request
needs one until it is scheduled, and requests repeating a schema reuse theirs."""


class GrammarCompiler(GrammarBackend):
    """A GrammarBackend whose matchers are compiled ahead, on a thread of their own (compile())."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._compiled_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: dict[str, Future] = {}
        """Requests waiting for their grammar: request id -> its compile."""

    # ---- requests waiting for their grammar (the engine's step loop) ------------------------------

    def start(self, request_id: str, structured: StructuredOutput) -> None:
        """The request waits for its grammar until compiled() names it."""
        self._waiting[request_id] = self.compile(structured)

    def forget(self, request_id: str) -> None:
        """The request left (aborted) before its grammar was compiled."""
        self._waiting.pop(request_id, None)

    def compiled(self) -> tuple[list[str], list[tuple[str, BaseException]]]:
        """The requests whose compile has ended since the last call: those ready, and those whose compile
        raised (with the exception). Neither is waiting any more."""
        ready, failed = [], []
        for request_id, compiling in list(self._waiting.items()):
            if compiling.done():
                del self._waiting[request_id]
                exc = compiling.exception()
                if exc is None:
                    ready.append(request_id)
                else:
                    failed.append((request_id, exc))
        return ready, failed

    def wait(self, timeout: float = WAIT_SECONDS) -> None:
        """Until a waiting request's compile ends, or timeout seconds (at once if none waits)."""
        if self._waiting:
            wait(self._waiting.values(), timeout, FIRST_COMPLETED)

    # ---- compiling ---------------------------------------------------------------------------------

    def compile(self, structured: StructuredOutput) -> Future:
        """Start compiling a grammar (done at once if it is held); the future's result is None, or the
        exception the compile raised."""
        key = (structured.kind, structured.spec)
        with self._compiled_lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                done: Future = Future()
                done.set_result(None)
                return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix="prescient-grammar", initializer=_yield_to_the_step
            )
        return self._pool.submit(self._build, key, structured)

    def _build(self, key: tuple[str, str], structured: StructuredOutput) -> None:
        matcher = super().matcher(structured)
        with self._compiled_lock:
            self._compiled[key] = matcher
            while len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)

    def matcher(self, structured: StructuredOutput, output_ids: list[int] = ()) -> llguidance.LLMatcher:
        with self._compiled_lock:
            compiled = self._compiled.get((structured.kind, structured.spec))
        if compiled is None:
            return super().matcher(structured, output_ids)
        matcher = compiled.deep_copy()
        for token in output_ids:
            matcher.consume_token(token)
        return matcher


COMPILE_NICENESS = 10
"""How much lower than the step loop the compile thread runs: on a host with few cores the step's own threads
come first, and the compile takes what is left."""


def _yield_to_the_step() -> None:
    """Lower the compile thread's priority (Linux schedules threads one by one; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):
        pass
