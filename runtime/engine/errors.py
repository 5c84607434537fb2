"""What an engine client raises to its caller, whichever engine (thread or process) is behind it."""

from __future__ import annotations

from runtime.engine.outputs import OutputDelta


class QueueFullError(RuntimeError):
    """More requests are waiting than the server admits; retry later."""


class EngineDeadError(RuntimeError):
    """The engine stopped after an internal error (or its process died); nothing more will be served."""


class RequestAbortedError(RuntimeError):
    """The server aborted this request (abort_all: shutdown after the drain timeout)."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its step raised); the engine keeps serving the others.

    `delta` is the failed sequence's final delta (finish_reason 'abort'), `cause` says what failed."""

    def __init__(self, delta: OutputDelta):
        super().__init__(f"request {delta.request_id} failed: {delta.error}")
        self.delta = delta
        self.cause = delta.error
