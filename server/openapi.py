"""GET /openapi.json: an OpenAPI 3.1 description of every route this server answers."""

from __future__ import annotations

from aiohttp import web

_ERROR = {
    "description": "Error (OpenAI envelope)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer"}}


def _sampling_properties() -> dict:
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "seed": {"type": "integer"},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stop_token_ids": {"type": "array", "items": {"type": "integer"}},
        "n": {
            "type": "integer",
            "minimum": 1,
            "maximum": 16,
            "description": "Choices per prompt; its sequences share the prompt's KV blocks (not with --engine-process)",
        },
        "user": {"type": "string"},
        "priority": {"type": "integer"},
        "logit_bias": {
            "type": "object",
            "description": "Token id (as a string) -> bias added to its logit",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "min_tokens": {
            "type": "integer",
            "minimum": 0,
            "description": "End of sequence and stop_token_ids are banned before this many",
        },
        "logprobs_mode": {
            "type": "string",
            "enum": ["raw", "processed"],
            "description": "raw: the model's log-softmax; processed: what was sampled from",
        },
        "response_format": {
            "type": "object",
            "required": ["type"],
            "description": "json_object / json_schema: enforced while decoding (the output parses and validates)",
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
        "ignore_eos": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    }


def _post(summary: str, schema: dict, ok: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": ok},
                "400": _ERROR,
                "401": _ERROR,
                "413": _ERROR,
                "429": _ERROR,
                "503": _ERROR,
            },
        }
    }


def document() -> dict:
    completion = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **_sampling_properties(),
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    _TOKENS,
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 64,
                        "description": "A batch: choices are prompt-major (prompt i, sample j has index i * n + j)",
                        "items": {"oneOf": [{"type": "string", "minLength": 1}, _TOKENS]},
                    },
                ]
            },
            "max_tokens": {
                "type": "integer",
                "minimum": 0,
                "description": "At least 1; 0 only with echo (score the prompt, generate nothing)",
            },
            "echo": {
                "type": "boolean",
                "description": "Return the prompt before the completion (and its logprobs)",
            },
            "logprobs": {
                "type": "integer",
                "minimum": 0,
                "maximum": 20,
                "description": "Logprob of each token and of this many most likely alternatives",
            },
            "best_of": {
                "type": "integer",
                "minimum": 1,
                "maximum": 16,
                "description": "Sequences sampled per prompt (>= n); the n with the highest mean logprob return",
            },
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
            "content": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                    },
                ]
            },
        },
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_sampling_properties(),
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "logprobs": {"type": "boolean", "description": "Return each generated token's logprob"},
            "top_logprobs": {
                "type": "integer",
                "minimum": 0,
                "maximum": 20,
                "description": "Most likely alternatives per token (needs logprobs: true)",
            },
            "messages": {"type": "array", "minItems": 1, "items": message},
            "tools": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                                "description": {"type": "string"},
                                "parameters": {"type": "object"},
                            },
                        },
                    },
                },
            },
            "tool_choice": {
                "description": "none, auto (default with tools), required, or a named function; "
                "required / named constrain the arguments to the function's schema",
                "oneOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "function"],
                        "properties": {
                            "type": {"const": "function"},
                            "function": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}},
                            },
                        },
                    },
                ],
            },
        },
    }
    get = lambda summary: {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}  # noqa: E731
    return {
        "openapi": "3.1.0",
        "info": {"title": "Prescient OpenAI-compatible server", "version": "0.1.0"},
        "paths": {
            "/v1/completions": _post(
                "Text completion (stream with SSE when stream=true)",
                completion,
                "text_completion, or an SSE stream of them",
            ),
            "/v1/chat/completions": _post(
                "Chat completion (stream with SSE when stream=true)",
                chat,
                "chat.completion, or an SSE stream of chat.completion.chunk",
            ),
            "/v1/models": get("Models served"),
            "/v1/models/{model}": get("One model served (404 for any other id)"),
            "/health": get("Liveness and readiness (503 while draining)"),
            "/metrics": get("Prometheus metrics"),
            "/tokenize": _post(
                "Text or chat messages to token ids",
                {
                    "type": "object",
                    "properties": {
                        "prompt": {"type": "string"},
                        "messages": {"type": "array", "items": message},
                    },
                },
                "tokens",
            ),
            "/detokenize": _post(
                "Token ids to text",
                {
                    "type": "object",
                    "required": ["tokens"],
                    "properties": {"tokens": {"type": "array", "items": {"type": "integer"}}},
                },
                "text",
            ),
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
                }
            }
        },
    }


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())
