"""Turn OpenAI request bodies into what the engine needs.

Each field's type and range are declared once in server/schema/request_fields.py (and published by
/openapi.json); RequestBody.read enforces them. What is left here are the rules between fields and the
shape the engine wants. Every check names the offending field; nothing here raises anything but
APIError, so a bad body can never turn into a 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler import SamplingParams, StructuredOutput
from scheduler.sampling_params import GREEDY_TEMPERATURE
from server.errors import bad_request
from server.schema.request_fields import CHAT, COMPLETION, MAX_N, MAX_SCHEMA_CHARS
from server.schema.schema_check import _show
from server.tools.tool_calls import ToolRequest, parse_tools


@dataclass
class GenerationRequest:
    prompt: str | list[int]
    """The first (or only) prompt; `prompts` holds them all."""
    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    priority: int
    model: str | None
    max_tokens_given: bool
    """False: generate up to the rest of the context (chat: max_tokens None) or 16 tokens (completions),
    as OpenAI does, lowered to what fits."""
    prompts: list[str | list[int]] | None = None
    """Every prompt of a batched completions request; choices are prompt-major (prompt i, sample j ->
    index i * n + j)."""
    echo: bool = False
    """Completions: return the prompt before the completion (and its logprobs when asked)."""
    echo_only: bool = False
    """echo with max_tokens 0: score the prompt, generate nothing."""
    n: int = 1
    """Choices returned per prompt."""
    best_of: int = 1
    """Completions: sequences sampled per prompt, of which the n with the highest mean logprob return."""
    logprobs_requested: bool = False
    """The client asked for logprobs (completions `logprobs`, chat `logprobs: true`)."""
    tools: ToolRequest | None = None
    """Chat: the functions the model may call and tool_choice."""

    def __post_init__(self) -> None:
        if self.prompts is None:
            self.prompts = [self.prompt]


def _max_tokens(v: dict, zero_allowed: bool) -> int | None:
    """max_completion_tokens (chat) wins over max_tokens."""
    name = "max_completion_tokens" if v.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = v.get(name)
    if max_tokens is not None and max_tokens < (0 if zero_allowed else 1):
        hint = (
            "" if zero_allowed or max_tokens != 0 else " (0 is allowed only with echo, to score the prompt)"
        )
        raise bad_request(
            f"'{name}' must be at least {0 if zero_allowed else 1}, got {_show(max_tokens)}{hint}", name
        )
    return max_tokens


def _logprobs(v: dict, chat: bool) -> int | None:
    """Alternatives per position asked for, or None. Completions: `logprobs: k`; chat: `logprobs: true`
    with `top_logprobs: k`."""
    if not chat:
        return v["logprobs"]
    if v["top_logprobs"] is not None and not v["logprobs"]:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (v["top_logprobs"] or 0) if v["logprobs"] else None


def _sampling(
    v: dict, default_max_tokens: int | None, chat: bool = False, tools: ToolRequest | None = None
) -> SamplingParams:
    max_tokens = _max_tokens(v, zero_allowed=not chat and v.get("echo", False))
    stop = v["stop"]
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    n = v["n"]
    best_of = n if chat or v["best_of"] is None else v["best_of"]
    if best_of < n:
        raise bad_request(f"'best_of' must be in [n={n}, {MAX_N}], got {_show(best_of)}", "best_of")
    if best_of > n and v["stream"]:
        raise bad_request(
            "'best_of' greater than 'n' cannot be streamed (the best are known at the end)", "best_of"
        )
    min_tokens = v["min_tokens"]
    if max_tokens and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    logprobs = _logprobs(v, chat)
    echo = not chat and v.get("echo", False)
    structured = _response_format(v["response_format"])
    if tools is not None and tools.constrained:
        if structured is not None:
            raise bad_request(
                "'response_format' cannot constrain the output when 'tool_choice' forces a tool call; "
                "send one of them",
                "response_format",
            )
        structured = tools.structured_output()
    if max_tokens == 0:  # echo with max_tokens 0: score the prompt; one token is sampled and dropped
        max_tokens = 1
    max_tokens = max_tokens or default_max_tokens
    try:  # SamplingParams holds the rules of the engine itself (e.g. at most 16 stop strings)
        return SamplingParams(
            max_tokens=max_tokens,
            # below GREEDY_TEMPERATURE is greedy: sent as 0, so that no step divides logits by it
            temperature=0.0 if v["temperature"] < GREEDY_TEMPERATURE else float(v["temperature"]),
            top_p=float(v["top_p"]),
            top_k=v["top_k"],
            seed=v["seed"],
            stop=stop,
            stop_token_ids=v["stop_token_ids"],
            ignore_eos=v["ignore_eos"],
            presence_penalty=float(v["presence_penalty"]),
            frequency_penalty=float(v["frequency_penalty"]),
            repetition_penalty=float(v["repetition_penalty"]),
            n=best_of,
            logprobs=logprobs if logprobs is not None else (0 if best_of > n else None),
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            logprobs_mode=v["logprobs_mode"],
            min_tokens=min(min_tokens, max_tokens or min_tokens),
            logit_bias={int(token): float(bias) for token, bias in v["logit_bias"].items()},
            structured_output=structured,
        )
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        raise bad_request(f"'{field_name}' {str(exc).split(' ', 1)[1]}", field_name) from exc


def _response_format(response_format: dict | None) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}.
    Whether the schema compiles is the engine's admission rule (a 400 naming response_format.json_schema)."""
    if response_format is None or response_format["type"] == "text":
        return None
    if response_format["type"] == "json_object":
        return StructuredOutput("json_object", source="response_format")
    spec = response_format.get("json_schema")
    if spec is None:
        raise bad_request(
            "'response_format.json_schema' is required with type 'json_schema': "
            '{"name": ..., "schema": {...}}',
            "response_format.json_schema",
            "missing_required_parameter",
        )
    schema = json.dumps(spec.get("schema") or {"type": "object"})
    if len(schema) > MAX_SCHEMA_CHARS:
        raise bad_request(
            f"'response_format.json_schema.schema' is {len(schema):,} characters as JSON, more than the "
            f"{MAX_SCHEMA_CHARS:,} allowed",
            "response_format.json_schema.schema",
        )
    return StructuredOutput("json_schema", schema, source="response_format.json_schema")


def _common(v: dict, prompts: list, default_max_tokens: int | None, chat: bool) -> GenerationRequest:
    stream = v["stream"]
    options = v["stream_options"]
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    given = v["max_tokens"] is not None or v.get("max_completion_tokens") is not None
    tools = parse_tools(v) if chat else None
    params = _sampling(v, default_max_tokens, chat, tools)
    echo = not chat and v.get("echo", False)
    return GenerationRequest(
        prompt=prompts[0],
        params=params,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        user=v["user"],
        priority=v["priority"],
        model=v["model"],
        max_tokens_given=given,
        prompts=prompts,
        echo=echo,
        echo_only=echo and given and v["max_tokens"] == 0,
        n=v["n"],
        best_of=params.n,
        # completions' `logprobs: 0` asks for the chosen tokens' logprobs with no alternatives (0 == False
        # in Python, so test identity); chat's `logprobs: false` asks for none
        logprobs_requested=v["logprobs"] is not None and v["logprobs"] is not False,
        tools=tools,
    )


def parse_completion(body: dict, default_max_tokens: int = 16) -> GenerationRequest:
    """POST /v1/completions. `prompt` is a string, an array of token ids, or an array of either (a batch)."""
    v = COMPLETION.read(body)
    prompt = v["prompt"]
    single = isinstance(prompt, str) or _is_token_id(prompt[0])
    return _common(v, [prompt] if single else prompt, default_max_tokens, chat=False)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_messages(messages: list[dict]) -> list[dict]:
    """Messages already checked against request_fields.MESSAGE, as the chat template reads them: content
    parts joined, a developer message read as system."""
    out = []
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content")
        if isinstance(content, list):  # text parts (the schema admits no other kind)
            content = "".join(part["text"] for part in content)
        if content is None:
            if role != "assistant":
                raise bad_request(
                    f"'messages[{i}].content' is required",
                    f"messages[{i}].content",
                    "missing_required_parameter",
                )
            content = ""
        if role == "assistant" and message.get("tool_calls"):
            content = _with_tool_calls(content, message["tool_calls"])
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _with_tool_calls(content: str, calls: list[dict]) -> str:
    """An assistant turn that called tools (checked against request_fields.TOOL_CALL), written back in
    the syntax the model calls them in."""
    text = content
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the text the client sent
        call_text = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        text += ("\n" if text else "") + f"<tool_call>\n{call_text}\n</tool_call>"
    return text


def parse_chat(body: dict) -> tuple[GenerationRequest, list[dict]]:
    """POST /v1/chat/completions; the prompt is rendered from the messages by the caller."""
    v = CHAT.read(body)
    return _common(v, [""], None, chat=True), parse_messages(v["messages"])
