"""What the request handlers share: the engine client, keys, metrics, drain state, and request logging."""

from __future__ import annotations

import asyncio
import json
import json.scanner
import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from runtime import EngineClient, RequestOutput
from server.auth import Tenant, user_tenant
from server.errors import APIError, bad_request
from server.metrics import ServerMetrics
from server.response_store import ResponseStore
from server.schema.schema_check import for_log

log = logging.getLogger("prescient.server")
T = TypeVar("T")


class ServerState:
    def __init__(
        self,
        client: EngineClient,
        api_keys: dict[str, Tenant | None] | None = None,
        served_model_name: str | None = None,
        tenant_metrics: bool = True,
    ):
        self.client = client
        """The one way to the engine (runtime/engine/client.py)."""
        self.api_keys = api_keys
        self.model_name = served_model_name or client.model_name
        self.model_names = {self.model_name, client.model_name}
        self.metrics = ServerMetrics(
            self.model_name,
            client.max_model_len,
            client.stats,
            {t.name for t in (api_keys or {}).values() if t is not None} | {user_tenant(api_keys, None).name},
            tenant_metrics=tenant_metrics,
        )
        self.metrics_auth = False
        """/metrics asks for an API key (the per-tenant series name tenants and their load)."""
        self.draining = False
        self.started = time.time()
        self.responses = ResponseStore()
        """Recent Responses' conversations per tenant, for previous_response_id."""

    @property
    def in_flight(self) -> int:
        """Requests the engine has not yet finished."""
        return self.client.num_in_flight

    def check_accepting(self) -> None:
        if self.draining:
            self.metrics.count_rejected("draining")
            raise APIError(
                503,
                "The server is shutting down and accepts no new requests; retry on another replica.",
                code="draining",
                headers={"Retry-After": "5"},
            )

    def record(self, request: web.Request, req, tenant: str, out: RequestOutput | None) -> None:
        """One log line and the metrics of a request that ended, however it ended."""
        if out is None:
            return
        if not out.finished:  # the client left: the engine aborted it
            out.finish_reason = "abort"
        self.metrics.observe_finished(out)
        ttft = (out.first_token_time - out.arrival_time) if out.first_token_time else None
        e2e = time.monotonic() - out.arrival_time
        log.info(
            "%s %s tenant=%s prompt=%d completion=%d cached=%d finish=%s ttft=%s e2e=%.3fs",
            request.method,
            request.path,
            for_log(tenant),
            len(out.prompt_token_ids),
            len(out.token_ids),
            out.num_cached_tokens,
            out.finish_reason,
            f"{ttft:.3f}s" if ttft is not None else "-",
            e2e,
        )


OFF_LOOP_BYTES = 16_384
"""A request whose body is longer than this (bytes, however it was sent: with a Content-Length or chunked)
is decoded, checked, rendered, tokenized and detokenized on a worker thread: work that grows with the body
never runs on the event loop, so /health and every other stream keep their latency while it is done
(tests/server/test_loop_stalls.py bounds /health's wait). Below it the work is too small to matter and a
thread hop would cost more than it saves."""


async def off_loop(size: int, work: Callable[..., T], *args) -> T:
    """work(*args), on a worker thread when `size` (the body's bytes) is over OFF_LOOP_BYTES."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, work, *args)
    return work(*args)


async def read_body(request: web.Request) -> bytes:
    """The raw body of a JSON request, or a 415 (not sent as application/json) or 413 (too large).

    Only application/json is read: a web page may POST text/plain or a form to a local server without a
    CORS preflight, and must not be able to make it work."""
    if request.content_type != "application/json":
        raise APIError(
            415,
            f"Send the body as JSON with 'Content-Type: application/json' (got {for_log(request.content_type)}).",
            code="unsupported_media_type",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(
            413, f"Request body too large: the limit is {request.app['max_body_bytes']} bytes."
        ) from exc


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object, or a 4xx naming what is wrong; a big body is decoded off the loop."""
    raw = await read_body(request)
    return await off_loop(len(raw), parse_json, raw)


YIELDING_JSON_BYTES = 262_144
"""Bodies longer than this are decoded with json's Python scanner (strings still decoded in C), which
lets the GIL go every few milliseconds: the C scanner holds it for the whole decode, so a
multi-megabyte body of small objects (tools) decoded on a worker thread would keep /health and every
stream waiting as long. The Python scanner is slower on such a body, but only the worker waits; a body
made of long strings (a prompt, messages) decodes as fast either way."""


def parse_json(raw: bytes) -> dict:
    """A body as a JSON object, or a 400 naming what is wrong."""
    try:
        if len(raw) > YIELDING_JSON_BYTES:
            body = _YIELDING.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
        else:
            body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"The body is not valid JSON: it is not UTF-8 ({exc.reason} at byte {exc.start})",
            code="invalid_json",
        ) from exc
    except RecursionError as exc:
        raise bad_request(
            "The body is not valid JSON for this server: it is nested too deeply", code="invalid_json"
        ) from exc
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer beyond Python's 4,300 digits
        raise bad_request(f"The body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request(f"The body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _reject_constant(name: str):
    """Python's json reads NaN and Infinity; JSON (RFC 8259) has no such numbers, and no field takes them."""
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise ValueError(f"the number {text[:40]} is out of range; send a finite number")
    return value


def _yielding_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


_YIELDING = _yielding_decoder()
