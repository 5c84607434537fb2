"""The request bodies of the APIs translated onto chat: OpenAI Responses, Anthropic Messages, Ollama.

Declared as JSON Schema, as server/schema/request_fields.py declares OpenAI's (the same RequestBody:
published by /openapi.json, enforced when read, unknown fields logged and ignored). Each translation
(server/responses/responses_api.py, server/anthropic/anthropic_api.py, server/ollama/ollama_api.py) then
writes a chat body, which the chat path checks again for everything else (ranges, tools, schemas), so the
rules live in one place.
"""

from __future__ import annotations

from server.schema.request_fields import (
    EMBED_INPUT,
    FUNCTION_NAME,
    MAX_MESSAGES,
    MAX_TOOLS,
    POOLING,
    SAMPLING,
    TOOL,
    RequestBody,
)

TEXT = {"type": "string"}
JSON_OBJECT = {"type": "object", "description": "A JSON Schema"}
TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["input_text", "output_text", "text"]},
            "text": TEXT,
        },
    },
    "title": "an array of text parts (input_text / output_text)",
}

# ---- OpenAI Responses --------------------------------------------------------------------------------

RESPONSE_ITEM = {
    "type": "object",
    "properties": {
        "type": {
            "type": "string",
            "enum": ["message", "function_call", "function_call_output"],
            "description": "message (the default), function_call (an earlier call), function_call_output "
            "(its result)",
        },
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [TEXT, TEXT_PARTS]},
        "call_id": TEXT,
        "name": TEXT,
        "arguments": TEXT,
        "output": TEXT,
    },
}
RESPONSE_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "function", "title": "'function' (the only tool this server runs)"},
        "name": FUNCTION_NAME,
        "description": TEXT,
        "parameters": JSON_OBJECT,
        "strict": {"type": "boolean"},
    },
}
RESPONSES = RequestBody(
    "POST /v1/responses",
    {
        "model": SAMPLING["model"],
        "input": {
            "oneOf": [
                TEXT,
                {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": RESPONSE_ITEM},
            ],
            "description": "A user message, or input items (messages, function calls and their outputs)",
        },
        "instructions": {**TEXT, "description": "A system message before the input (not carried over)"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": SAMPLING["temperature"],
        "top_p": SAMPLING["top_p"],
        "seed": SAMPLING["seed"],
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": RESPONSE_TOOL},
        "tool_choice": {
            "oneOf": [
                {"type": "string", "enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": TEXT},
                },
            ]
        },
        "text": {
            "type": "object",
            "properties": {
                "format": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                        "name": TEXT,
                        "schema": JSON_OBJECT,
                        "strict": {"type": "boolean"},
                    },
                }
            },
        },
        "stream": SAMPLING["stream"],
        "previous_response_id": {
            **TEXT,
            "description": "Continue that response's conversation (kept per tenant, the most recent ones)",
        },
        "store": {"type": "boolean", "default": True, "description": "Keep it for previous_response_id"},
        "user": SAMPLING["user"],
        "metadata": {"type": "object"},
        "parallel_tool_calls": {"type": "boolean"},
    },
    required=("input",),
)

# ---- Anthropic Messages ------------------------------------------------------------------------------

TEXT_OR_TEXT_BLOCKS = {
    "oneOf": [
        TEXT,
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": TEXT},
            },
        },
    ]
}
"""A string, or a list of {"type": "text", "text": ...} blocks (Anthropic's system and tool_result content)."""
ANTHROPIC_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use", "tool_result"]},
        "text": TEXT,
        "id": TEXT,
        "name": TEXT,
        "input": {"type": "object"},
        "tool_use_id": TEXT,
        "content": TEXT_OR_TEXT_BLOCKS,
        "is_error": {"type": "boolean"},
    },
}
ANTHROPIC_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "maxItems": MAX_MESSAGES,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"oneOf": [TEXT, {"type": "array", "items": ANTHROPIC_BLOCK}]},
        },
    },
}
ANTHROPIC_SYSTEM = TEXT_OR_TEXT_BLOCKS
ANTHROPIC_TOOLS = {
    "type": "array",
    "maxItems": MAX_TOOLS,
    "items": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": FUNCTION_NAME, "description": TEXT, "input_schema": JSON_OBJECT},
    },
}
ANTHROPIC_TOOL_CHOICE = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": TEXT},
}
MESSAGES = RequestBody(
    "POST /v1/messages",
    {
        "model": SAMPLING["model"],
        "messages": ANTHROPIC_MESSAGES,
        "system": ANTHROPIC_SYSTEM,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1, "default": 1.0},
        "top_p": SAMPLING["top_p"],
        "top_k": SAMPLING["top_k"],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": ANTHROPIC_TOOL_CHOICE,
        "stream": SAMPLING["stream"],
        "metadata": {"type": "object", "properties": {"user_id": SAMPLING["user"]}},
    },
    required=("model", "messages", "max_tokens"),
)
COUNT_TOKENS = RequestBody(
    "POST /v1/messages/count_tokens",
    {
        "model": SAMPLING["model"],
        "messages": ANTHROPIC_MESSAGES,
        "system": ANTHROPIC_SYSTEM,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": ANTHROPIC_TOOL_CHOICE,
    },
    required=("model", "messages"),
)

# ---- Ollama -------------------------------------------------------------------------------------------

OLLAMA_OPTIONS = {
    "type": "object",
    "properties": {
        "num_predict": {"type": "integer", "description": "Most tokens to generate; -1: as many as fit"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_k": {"type": "integer", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "seed": SAMPLING["seed"],
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "repeat_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "presence_penalty": SAMPLING["presence_penalty"],
        "frequency_penalty": SAMPLING["frequency_penalty"],
    },
    "description": "Ollama's model options; others (num_ctx, num_thread, ...) are ignored",
}
OLLAMA_FORMAT = {
    "oneOf": [{"type": "string", "enum": ["json", ""]}, JSON_OBJECT],
    "description": "'json' (any JSON object) or a JSON Schema the reply must follow",
}
OLLAMA_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": TEXT,
        "tool_calls": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["function"],
                "properties": {
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": TEXT, "arguments": {"type": "object"}},
                    }
                },
            },
        },
        "tool_name": TEXT,
    },
}
OLLAMA_COMMON = {
    "model": SAMPLING["model"],
    "format": OLLAMA_FORMAT,
    "options": OLLAMA_OPTIONS,
    "stream": {"type": "boolean", "default": True, "description": "NDJSON, one object per line (default)"},
    "keep_alive": {"oneOf": [TEXT, {"type": "number"}], "description": "Accepted; the model stays loaded"},
    "think": {"type": "boolean", "description": "Accepted; this server's models do not think aloud"},
}
OLLAMA_CHAT = RequestBody(
    "POST /api/chat",
    {
        **OLLAMA_COMMON,
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": OLLAMA_MESSAGE},
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": TOOL, "description": "As chat's"},
    },
    required=("messages",),
)
OLLAMA_GENERATE = RequestBody(
    "POST /api/generate",
    {
        **OLLAMA_COMMON,
        "prompt": TEXT,
        "system": TEXT,
        "raw": {"type": "boolean", "default": False, "description": "The prompt as is, without the template"},
        "suffix": {"type": "string", "maxLength": 0, "title": "absent or empty (insertion is not supported)"},
    },
)
OLLAMA_EMBED = RequestBody(
    "POST /api/embed",
    {
        "model": SAMPLING["model"],
        "input": EMBED_INPUT,
        "truncate": {"type": "boolean", "default": True, "description": "Cut inputs to the context"},
        "options": {"type": "object"},
        "keep_alive": OLLAMA_COMMON["keep_alive"],
        "dimensions": {"type": "integer", "minimum": 1},
        "pooling": POOLING,
    },
    required=("input",),
)
OLLAMA_SHOW = RequestBody(
    "POST /api/show",
    {"model": SAMPLING["model"], "name": SAMPLING["model"], "verbose": {"type": "boolean"}},
)
