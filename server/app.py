"""The aiohttp application: routes, the error middleware, and the engine thread's lifetime."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from runtime import EngineClient
from server import openapi
from server.anthropic import anthropic_api
from server.auth import Tenant
from server.config import ServerConfig
from server.errors import APIError, error_style
from server.not_found_log import NotFoundLog
from server.ollama import ollama_api
from server.openai import embeddings_api, openai_api, utility_api
from server.responses import responses_api
from server.state import ServerState

if TYPE_CHECKING:
    from runtime import Engine

log = logging.getLogger("prescient.server")


@web.middleware
async def errors_as_envelopes(request: web.Request, handler):
    """Every error leaves in the envelope of the API its route speaks (OpenAI's, Anthropic's, Ollama's); an
    unexpected one is logged here, never sent as a traceback."""
    style = error_style(request.path)
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response(style)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            request.app["not_found_log"].record(request.method, request.path)
        message = {
            404: f"No route {request.method} {request.path}; see GET /openapi.json.",
            405: f"Method {request.method} is not allowed on {request.path}.",
            413: f"Request body too large: the limit is {request.app['max_body_bytes']} bytes.",
        }
        return APIError(exc.status, message.get(exc.status, exc.reason)).response(
            style
        )  # code from the status
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        error_id = uuid.uuid4().hex
        log.exception("internal error %s on %s %s", error_id, request.method, request.path)
        return APIError(500, f"Internal server error; it is logged under error id {error_id}.").response(
            style
        )


@web.middleware
async def count_responses(request: web.Request, handler):
    """prescient:http_responses_total by route pattern (bounded: unknown paths are "unmatched") and status."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    metrics = request.app["state"].metrics
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # what errors_as_envelopes lets through (redirects)
        metrics.count_response(route, exc.status)
        raise
    metrics.count_response(route, response.status)
    return response


def build_app(
    client: EngineClient | Engine,
    *,
    api_keys: dict[str, Tenant | None] | None = None,
    max_body_bytes: int = ServerConfig.max_body_bytes,
    served_model_name: str | None = None,
    throughput_log_seconds: float = ServerConfig.throughput_log_seconds,
    metrics_auth: bool = ServerConfig.metrics_auth,
    tenant_metrics: bool = ServerConfig.tenant_metrics,
) -> web.Application:
    """The app over an engine client (an Engine is wrapped in AsyncEngine, the in-process client);
    it starts the client's loop with the app and stops it after. metrics_auth: /metrics answers only
    with one of api_keys; tenant_metrics: export per-tenant series."""
    if metrics_auth and not api_keys:
        raise ValueError(
            "--metrics-auth needs --api-key or --api-keys: /metrics then asks for one of those keys"
        )
    if not isinstance(client, EngineClient):  # an Engine: served in this process
        from runtime import AsyncEngine

        client = AsyncEngine(client, max_waiting=ServerConfig.max_waiting)
    app = web.Application(middlewares=[count_responses, errors_as_envelopes], client_max_size=max_body_bytes)
    app["max_body_bytes"] = max_body_bytes
    app["not_found_log"] = NotFoundLog()
    state = ServerState(client, api_keys, served_model_name, tenant_metrics=tenant_metrics)
    state.metrics_auth = metrics_auth
    app["state"] = state
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/embeddings", embeddings_api.embeddings)
    app.router.add_post("/v1/responses", responses_api.responses)
    app.router.add_post("/v1/messages", anthropic_api.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic_api.count_tokens)
    app.router.add_post("/api/chat", ollama_api.chat)
    app.router.add_post("/api/generate", ollama_api.generate)
    app.router.add_post("/api/embed", ollama_api.embed_route)
    app.router.add_get("/api/tags", ollama_api.tags)
    app.router.add_post("/api/show", ollama_api.show)
    app.router.add_get("/api/version", ollama_api.version)
    app.router.add_get("/v1/models", utility_api.models)
    app.router.add_get("/v1/models/{model}", utility_api.model)
    app.router.add_get("/health", utility_api.health)
    app.router.add_get("/metrics", utility_api.metrics)
    app.router.add_get("/version", utility_api.version)
    app.router.add_post("/tokenize", utility_api.tokenize)
    app.router.add_post("/detokenize", utility_api.detokenize)
    app.router.add_get("/openapi.json", openapi.openapi)

    async def lifetime(app: web.Application):
        client.start()
        # What start-up made (modules, the tokenizer's vocabulary, ...) lives as long as the server: out
        # of the collector's sight, a full collection no longer walks it, which a big request body (a
        # JSON decode makes an object per value, and holds the GIL meanwhile) would otherwise trigger
        # again and again while the event loop waits (tests/server/test_loop_stalls.py).
        gc.freeze()
        logger = asyncio.create_task(_log_throughput(state, throughput_log_seconds))
        yield
        logger.cancel()
        await client.shutdown()

    app.cleanup_ctx.append(lifetime)
    return app


async def _log_throughput(state: ServerState, every: float) -> None:
    """A line every few seconds while there is work: tokens/s, batch, queue, KV usage."""

    def snapshot():
        stats = state.client.stats()
        return time.monotonic(), stats.get("generated_tokens", 0), stats.get("computed_tokens", 0), stats

    last = snapshot()
    while True:
        await asyncio.sleep(every)
        now = snapshot()
        stats = now[3]
        if stats.get("num_running") or stats.get("num_waiting") or now[1] != last[1]:
            span = now[0] - last[0]
            generated = now[1] - last[1]
            log.info(
                "throughput: %.1f generated tokens/s, %.1f prompt tokens/s; running %d, waiting %d, "
                "KV usage %.1f%%",
                generated / span,
                (now[2] - last[2] - generated) / span,
                stats.get("num_running", 0),
                stats.get("num_waiting", 0),
                100 * stats.get("kv_usage", 0.0),
            )
        last = now
