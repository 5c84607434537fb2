"""What a client is told when the engine fails its request: an APIError naming the kind of failure and
the request id, with a code to branch on; the details go to the log, never to the client."""

from __future__ import annotations

import logging

from runtime import EngineDeadError, RequestAbortedError, RequestFailedError
from server.errors import APIError

log = logging.getLogger("prescient.server")


def engine_failure(exc: Exception, request_id: str) -> APIError:
    """engine_error (this request failed, the engine serves on), shutdown (aborted by a drain: retry on
    another replica), engine_dead (the engine stopped), or internal_error (a bug, logged with a traceback)."""
    if isinstance(exc, RequestFailedError):
        log.error("request %s failed in the engine (%s); the engine keeps serving", request_id, exc.cause)
        return APIError(
            500,
            f"The engine failed while generating this request ({exc.cause}); other "
            f"requests are unaffected, retry it. Request id {request_id}.",
            code="engine_error",
        )
    if isinstance(exc, RequestAbortedError):
        log.warning("request %s aborted: %s", request_id, exc)
        return APIError(
            503,
            f"The server aborted this request: {exc}; retry on another replica. Request id {request_id}.",
            code="shutdown",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, EngineDeadError):
        log.error("request %s: the engine has stopped", request_id)
        return APIError(
            500,
            f"The engine has stopped after an internal error; retry on another replica. Request id {request_id}.",
            code="engine_dead",
        )
    log.exception("internal error on request %s", request_id)
    return APIError(500, f"Internal server error; it is logged under request id {request_id}.")
