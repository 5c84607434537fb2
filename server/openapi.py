"""GET /openapi.json: an OpenAPI 3.1 description of every route this server answers."""

from __future__ import annotations

from aiohttp import web

from server.openai.utility_api import server_version
from server.schema.compat_fields import (
    COUNT_TOKENS,
    MESSAGES,
    OLLAMA_CHAT,
    OLLAMA_EMBED,
    OLLAMA_GENERATE,
    OLLAMA_SHOW,
    RESPONSES,
)
from server.schema.request_fields import CHAT, COMPLETION, DETOKENIZE, EMBEDDINGS, TOKENIZE

_ERROR = {
    "description": "Error (OpenAI envelope)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


_ANTHROPIC_ERROR = {
    "description": "Error (Anthropic envelope)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}},
}
_OLLAMA_ERROR = {
    "description": "Error (Ollama: the message alone)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OllamaError"}}},
}


def _post(summary: str, schema: dict, ok: str, error: dict = _ERROR) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": ok},
                **{status: error for status in ("400", "401", "413", "415", "429", "503")},
            },
        }
    }


def document() -> dict:
    """Request bodies come from server/schema/request_fields.py, the tables the server validates with."""
    get = lambda summary: {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}  # noqa: E731
    return {
        "openapi": "3.1.0",
        "info": {"title": "Prescient OpenAI-compatible server", "version": server_version()},
        "paths": {
            "/v1/completions": _post(
                "Text completion (stream with SSE when stream=true)",
                COMPLETION.schema(),
                "text_completion, or an SSE stream of them",
            ),
            "/v1/chat/completions": _post(
                "Chat completion (stream with SSE when stream=true)",
                CHAT.schema(),
                "chat.completion, or an SSE stream of chat.completion.chunk",
            ),
            "/v1/embeddings": _post(
                "Embeddings: pooled, normalised final hidden states of the model served",
                EMBEDDINGS.schema(),
                "a list of embedding objects",
            ),
            "/v1/responses": _post(
                "OpenAI Responses (stream with its named SSE events when stream=true)",
                RESPONSES.schema(),
                "a response object, or an SSE stream of response events",
            ),
            "/v1/messages": _post(
                "Anthropic Messages (x-api-key or Bearer; Anthropic's SSE events when stream=true)",
                MESSAGES.schema(),
                "a message, or an SSE stream of message events",
                _ANTHROPIC_ERROR,
            ),
            "/v1/messages/count_tokens": _post(
                "Anthropic: the prompt tokens a Messages body renders to",
                COUNT_TOKENS.schema(),
                "{input_tokens}",
                _ANTHROPIC_ERROR,
            ),
            "/api/chat": _post(
                "Ollama chat (NDJSON stream unless stream=false)",
                OLLAMA_CHAT.schema(),
                "NDJSON lines of chat pieces, the last with done=true",
                _OLLAMA_ERROR,
            ),
            "/api/generate": _post(
                "Ollama generate (NDJSON stream unless stream=false; raw: no template)",
                OLLAMA_GENERATE.schema(),
                "NDJSON lines of response pieces, the last with done=true",
                _OLLAMA_ERROR,
            ),
            "/api/embed": _post("Ollama embeddings", OLLAMA_EMBED.schema(), "{embeddings}", _OLLAMA_ERROR),
            "/api/show": _post(
                "Ollama: the model's details", OLLAMA_SHOW.schema(), "model details", _OLLAMA_ERROR
            ),
            "/api/tags": get("Ollama: models served"),
            "/api/version": get("Ollama: the server's version"),
            "/v1/models": get("Models served"),
            "/v1/models/{model}": get("One model served (404 for any other id)"),
            "/health": get("Liveness and readiness (503 while draining)"),
            "/metrics": get("Prometheus metrics"),
            "/version": get("The server's version"),
            "/tokenize": _post("Text or chat messages to token ids", TOKENIZE.schema(), "tokens"),
            "/detokenize": _post("Token ids to text", DETOKENIZE.schema(), "text"),
            "/openapi.json": get("This document"),
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "integer", "null"]},
                            },
                        }
                    },
                },
                "AnthropicError": {
                    "type": "object",
                    "properties": {
                        "type": {"const": "error"},
                        "error": {
                            "type": "object",
                            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                        },
                    },
                },
                "OllamaError": {"type": "object", "properties": {"error": {"type": "string"}}},
            }
        },
    }


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())
