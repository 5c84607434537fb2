"""Every field a request body may carry, declared once as JSON Schema: /openapi.json publishes these
schemas and RequestBody.read enforces them (server/schema/schema_check.py), so the two cannot drift.

A field has an effect only if it is declared here. A field that is not declared is ignored, as vLLM
does and as OpenAI's SDKs expect of a compatible server (clients send `store`, `metadata`,
`service_tier`, ...): the server logs its name at WARNING and answers as if it were absent. Fields whose
meaning this server cannot honour (`suffix`, `functions`, ...) are declared with the only value it
accepts, so they get a 400 naming them instead of being dropped silently.

To add a field: declare its schema in the right table (with `default` where there is one), then read it
in server/openai/protocol.py from the dict RequestBody.read returns. Rules between fields (best_of >= n,
min_tokens <= max_tokens) are checked there, and said in the fields' descriptions.
"""

from __future__ import annotations

import copy
import logging

from scheduler.sampling_params import MAX_LOGPROBS, SEED_RANGE
from server.schema.schema_check import check_object, for_log

log = logging.getLogger("prescient.server")

MAX_N = 16
"""Most choices (n, best_of) per prompt."""
MAX_PROMPTS = 64
"""Most prompts in one batched completions request."""
MAX_TOOLS = 128
"""Most functions in `tools`, as OpenAI allows."""
MAX_MESSAGES = 2048
"""Most chat messages in one request, as OpenAI allows."""
MAX_LOGIT_BIAS = 300
"""Most token ids in `logit_bias`, as OpenAI allows."""
MAX_USER_CHARS = 256
"""Longest `user` (it names a tenant: kept in memory, in metrics labels and in logs)."""
MAX_SCHEMA_CHARS = 131_072
"""Longest JSON schema (response_format.json_schema.schema, or the tools a forced call is constrained
to), as JSON text: it is compiled into a grammar and cached by the server and the engine."""
MAX_ECHO_LOGPROBS = 65_536
"""Most prompt logprob entries one completions request may ask echo to return: prompt tokens x
(1 + logprobs) x n, summed over its prompts. Echo costs no decoding, so without a bound a small request
would ask for a reply a hundred times its size."""
MAX_LOGGED_NAMES = 10
"""Unknown field names written to the log per request."""
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

TOKENS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer"},
    "title": "an array of token ids",
    "description": "At most the model's context (max_model_len of GET /v1/models) ids, each in the vocabulary",
}


def _none_but(value_schema: dict, why: str) -> dict:
    """A field this server cannot honour: only an empty value is accepted."""
    return {**value_schema, "title": f"absent, null or empty ({why})", "description": why}


SAMPLING = {
    "model": {"type": "string", "description": "A model id from GET /v1/models; absent: the one served"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1.0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
    "top_k": {"type": "integer", "minimum": -1, "default": -1, "description": "-1: disabled"},
    "seed": {
        "type": "integer",
        "minimum": SEED_RANGE[0],
        "maximum": SEED_RANGE[1] - 1,
        "title": "an integer that fits in 64 bits, in [-2**63, 2**64)",
        "description": "Reproducible sampling; choice i of n uses seed + i",
    },
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}},
        ],
        "description": "Text that ends generation; it is not returned",
    },
    "stop_token_ids": {
        "type": "array",
        "items": {"type": "integer"},
        "default": [],
        "description": "Token ids that end generation (returned as stop_reason)",
    },
    "ignore_eos": {
        "type": "boolean",
        "default": False,
        "description": "Keep generating past the end-of-sequence token",
    },
    "n": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_N,
        "default": 1,
        "description": "Choices per prompt; its sequences share the prompt's KV blocks",
    },
    "user": {
        "type": "string",
        "maxLength": MAX_USER_CHARS,
        "description": "End user; without API keys (or with a key of --api-key) it names the tenant for fair "
        "scheduling; beside --api-keys such tenants are counted apart from the key file's",
    },
    "priority": {
        "type": "integer",
        "default": 0,
        "description": "Lower runs first under --policy priority; [0, 2^20] unless the API key grants more",
    },
    "logit_bias": {
        "type": "object",
        "default": {},
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": r"^-?[0-9]+$", "title": "token ids (integers written as strings)"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "Token id (as a string, in the vocabulary) -> bias added to its logit",
    },
    "min_tokens": {
        "type": "integer",
        "minimum": 0,
        "default": 0,
        "description": "End of sequence and stop_token_ids are banned before this many (at most max_tokens)",
    },
    "logprobs_mode": {
        "type": "string",
        "enum": ["raw", "processed"],
        "default": "raw",
        "description": "raw: the model's log-softmax; processed: what was sampled from",
    },
    "response_format": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "schema": {
                        "type": "object",
                        "description": "The JSON Schema the output validates against; at most "
                        f"{MAX_SCHEMA_CHARS:,} characters as JSON text",
                    },
                    "strict": {"type": "boolean"},
                },
                "description": "With type json_schema",
            },
        },
        "description": "json_object / json_schema are enforced while decoding: the output parses and validates",
    },
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean", "default": False}},
        "description": "Only with stream: true",
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0.0},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0.0},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10, "default": 1.0},
    "functions": _none_but({"type": "array", "maxItems": 0}, "functions are not supported by this server"),
}

COMPLETION_ONLY = {
    "prompt": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            TOKENS,
            {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_PROMPTS,
                "items": {"oneOf": [{"type": "string", "minLength": 1}, TOKENS]},
                "title": "an array of prompts (strings or arrays of token ids)",
            },
        ],
        "description": "A batch: choices are prompt-major (prompt i, sample j has index i * n + j)",
    },
    "max_tokens": {
        "type": "integer",
        "minimum": 0,
        "description": "Default 16, lowered to fit the context; 0 only with echo (score the prompt)",
    },
    "echo": {
        "type": "boolean",
        "default": False,
        "description": "Return the prompt before the completion (and its logprobs)",
    },
    "logprobs": {
        "type": "integer",
        "minimum": 0,
        "maximum": MAX_LOGPROBS,
        "description": "Logprob of each token and of this many most likely alternatives; with echo, "
        f"prompt tokens x (1 + logprobs) x n summed over the prompts is at most {MAX_ECHO_LOGPROBS:,}",
    },
    "best_of": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_N,
        "description": "Sequences sampled per prompt (>= n, default n); the n with the highest mean logprob "
        "return; not with stream",
    },
    "suffix": _none_but({"type": "string", "maxLength": 0}, "suffix (insertion) is not supported"),
    "tools": _none_but({"type": "array", "maxItems": 0}, "tools are a chat field: use /v1/chat/completions"),
}

TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"const": "text", "title": "'text' (this model reads text only)"},
        "text": {"type": "string"},
    },
}
FUNCTION_NAME = {
    "type": "string",
    "pattern": "^[A-Za-z0-9_.\\-]{1,64}$",
    "title": "1-64 of A-Z a-z 0-9 _ . -",
}


def _function_object(function_properties: dict, required: list[str], **properties) -> dict:
    """A chat API object of type "function" (a tool, a tool call, a named tool_choice): `properties`, then
    its type and its function, whose name is required."""
    return {
        "type": "object",
        "required": required,
        "properties": {
            **properties,
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": function_properties},
        },
    }


TOOL_CALL = _function_object(
    {"name": {"type": "string"}, "arguments": {"type": "string"}}, ["function"], id={"type": "string"}
)
TOOL = _function_object(
    {
        "name": FUNCTION_NAME,
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "JSON Schema of the arguments"},
        "strict": {"type": "boolean"},
    },
    ["type", "function"],
)
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": TEXT_PART, "title": "an array of text parts"},
            ],
            "description": "Required except for an assistant message; developer is read as system",
        },
        "tool_calls": {"type": "array", "items": TOOL_CALL, "description": "An assistant turn's calls"},
        "tool_call_id": {"type": "string", "description": "A tool message: the call it answers"},
    },
}

CHAT_ONLY = {
    "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": MESSAGE},
    "max_tokens": {
        "type": "integer",
        "minimum": 1,
        "description": "Deprecated by OpenAI for max_completion_tokens; default: the rest of the context",
    },
    "max_completion_tokens": {"type": "integer", "minimum": 1, "description": "Wins over max_tokens"},
    "logprobs": {"type": "boolean", "default": False, "description": "Return each generated token's logprob"},
    "top_logprobs": {
        "type": "integer",
        "minimum": 0,
        "maximum": MAX_LOGPROBS,
        "description": "Most likely alternatives per token (needs logprobs: true)",
    },
    "tools": {
        "type": "array",
        "maxItems": MAX_TOOLS,
        "items": TOOL,
        "description": "Functions the model may call; rendered through the chat template's tools variable, "
        "or a system message when it has none. With tool_choice required or named, the schema of the "
        f"calls allowed is at most {MAX_SCHEMA_CHARS:,} characters as JSON text",
    },
    "tool_choice": {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            _function_object({"name": {"type": "string"}}, ["type", "function"]),
        ],
        "description": "auto (default with tools), none, required, or a named function; required and named "
        "constrain the call's arguments to the function's schema",
    },
    "function_call": _none_but({"type": "string", "enum": ["none"]}, "functions are not supported"),
}


class RequestBody:
    """The fields of one route's JSON body: their schema (for /openapi.json) and their check."""

    def __init__(self, route: str, properties: dict[str, dict], required: tuple[str, ...] = ()):
        self.route = route
        self.properties = properties
        self.required = required

    def read(self, body: dict) -> dict:
        """Each declared field's value (its default where absent or null), or a 400 naming the first
        field that does not fit its schema. Undeclared fields are logged and left out."""
        check_object(body, {"properties": self.properties, "required": self.required}, "")
        ignored = [name for name in body if name not in self.properties]
        if ignored:  # the client's names, escaped and cut short: a log line per request, never a flood
            shown = ", ".join(for_log(name) for name in sorted(ignored)[:MAX_LOGGED_NAMES])
            more = f" and {len(ignored) - MAX_LOGGED_NAMES} more" if len(ignored) > MAX_LOGGED_NAMES else ""
            log.warning("%s: ignored fields not supported by this server: %s%s", self.route, shown, more)
        out = {}
        for name, schema in self.properties.items():
            value = body.get(name)
            out[name] = copy.deepcopy(schema.get("default")) if value is None else value
        return out

    def schema(self) -> dict:
        """The OpenAPI (JSON Schema 2020-12) description: every optional field may also be null."""
        return {
            "type": "object",
            "required": list(self.required),
            "properties": {
                name: s if name in self.required else _nullable(s) for name, s in self.properties.items()
            },
            "additionalProperties": True,
            "description": "Fields not listed here are ignored (and logged), as vLLM does.",
        }


def _nullable(schema: dict) -> dict:
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return {**schema, "type": [kinds, "null"]}
    if "oneOf" in schema:
        return {**schema, "oneOf": [*schema["oneOf"], {"type": "null"}]}
    return {"anyOf": [schema, {"type": "null"}]}


COMPLETION = RequestBody("POST /v1/completions", {**SAMPLING, **COMPLETION_ONLY}, required=("prompt",))
CHAT = RequestBody("POST /v1/chat/completions", {**SAMPLING, **CHAT_ONLY}, required=("messages",))
TOKENIZE = RequestBody(
    "POST /tokenize",
    {
        "prompt": {"type": "string", "description": "Text to tokenize (or send messages)"},
        "messages": {**CHAT_ONLY["messages"], "description": "Chat messages, rendered by the chat template"},
        "add_generation_prompt": {
            "type": "boolean",
            "default": True,
            "description": "With messages: end with the assistant's turn header",
        },
        "add_special_tokens": {
            "type": "boolean",
            "description": "Add the tokenizer's special tokens (BOS); default true for prompt, false for "
            "messages (the chat template writes its own)",
        },
        "model": SAMPLING["model"],
    },
)
DETOKENIZE = RequestBody(
    "POST /detokenize",
    {"tokens": {"type": "array", "items": {"type": "integer"}}, "model": SAMPLING["model"]},
    required=("tokens",),
)
MAX_EMBED_INPUTS = 2048
"""Most inputs in one embeddings request, as OpenAI allows."""
EMBED_INPUT = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_EMBED_INPUTS,
            "items": {"type": "string", "minLength": 1},
        },
        TOKENS,
        {"type": "array", "minItems": 1, "maxItems": MAX_EMBED_INPUTS, "items": TOKENS},
    ],
    "description": "A text, texts, token ids, or arrays of token ids; each is embedded on its own, at most "
    "the model's context",
}
POOLING = {
    "type": "string",
    "enum": ["last", "mean"],
    "default": "last",
    "description": "How the final hidden states of the input's tokens make one vector (then L2-normalised): "
    "the last token's, or their mean",
}
EMBEDDINGS = RequestBody(
    "POST /v1/embeddings",
    {
        "input": EMBED_INPUT,
        "model": SAMPLING["model"],
        "encoding_format": {
            "type": "string",
            "enum": ["float", "base64"],
            "default": "float",
            "description": "base64: little-endian float32 bytes",
        },
        "dimensions": {
            "type": "integer",
            "minimum": 1,
            "description": "Only the model's hidden size (vectors are not shortened)",
        },
        "user": SAMPLING["user"],
        "pooling": POOLING,
    },
    required=("input",),
)
