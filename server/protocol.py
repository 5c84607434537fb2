"""Parse and validate OpenAI request bodies into what the engine needs.

Every check names the offending field; nothing here raises anything but
APIError, so a bad body can never turn into a 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler import SamplingParams, StructuredOutput
from scheduler.sampling_params import MAX_LOGPROBS
from server.errors import bad_request
from server.tool_calls import ToolRequest, parse_tools

_MISSING = object()
MAX_N = 16
"""Most choices (n, best_of) per prompt."""
MAX_PROMPTS = 64
"""Most prompts in one batched completions request."""
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


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


def _get(body: dict, name: str, kinds: tuple, default=None, what: str | None = None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"'{name}' must be {what or _kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {what or _kind_names(kinds)}, got {type(value).__name__}", name)
    return value


def _kind_names(kinds: tuple) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = _get(body, name, (int, float), default, "a number")
    # `not (inside)` also catches NaN, which compares false with everything
    if not ((value > low if low_open else value >= low) and value <= high):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad_request(f"'{name}' must be in {interval} (a finite number), got {_show(value)}", name)
    return float(value)


def _show(value) -> str:
    """A client's value for an error message, cut short (an integer may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]


def _max_tokens(body: dict, zero_allowed: bool) -> int | None:
    max_tokens = (
        _get(body, "max_completion_tokens", (int,), None) if "max_completion_tokens" in body else None
    )
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), None)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens < (0 if zero_allowed else 1):
        hint = (
            "" if zero_allowed or max_tokens != 0 else " (0 is allowed only with echo, to score the prompt)"
        )
        raise bad_request(
            f"'{name}' must be at least {0 if zero_allowed else 1}, got {_show(max_tokens)}{hint}", name
        )
    return max_tokens


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per position asked for, or None. Completions: `logprobs: k`; chat: `logprobs: true`
    with `top_logprobs: k`."""
    if chat:
        wanted = _get(body, "logprobs", (bool,), False)
        top = _get(body, "top_logprobs", (int,), None)
        if top is not None and not wanted:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        name, k = "top_logprobs", (top or 0) if wanted else None
    else:
        name, k = "logprobs", _get(body, "logprobs", (int,), None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def _logit_bias(body: dict) -> dict[int, float]:
    bias = _get(body, "logit_bias", (dict,), {})
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(
                f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for {key}", "logit_bias"
            )
        out[token] = float(value)
    return out


def _sampling(body: dict, default_max_tokens: int | None, chat: bool = False) -> SamplingParams:
    max_tokens = _max_tokens(body, zero_allowed=not chat and body.get("echo") is True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _get(body, "top_k", (int,), -1)
    if top_k < -1:
        raise bad_request(f"'top_k' must be -1 (disabled) or a positive integer, got {_show(top_k)}", "top_k")
    seed = _get(body, "seed", (int,), None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if any(not s for s in stop):
        raise bad_request("'stop' strings must not be empty", "stop")
    stop_token_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise bad_request("'stop_token_ids' must be an array of integers", "stop_token_ids")
    ignore_eos = _get(body, "ignore_eos", (bool,), False)
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be in [1, {MAX_N}], got {_show(n)}", "n")
    best_of = n if chat else _get(body, "best_of", (int,), n)
    if not n <= best_of <= MAX_N:
        raise bad_request(f"'best_of' must be in [n={n}, {MAX_N}], got {_show(best_of)}", "best_of")
    if best_of > n and body.get("stream"):
        raise bad_request(
            "'best_of' greater than 'n' cannot be streamed (the best are known at the end)", "best_of"
        )
    min_tokens = _get(body, "min_tokens", (int,), 0)
    if min_tokens < 0:
        raise bad_request(f"'min_tokens' must be >= 0, got {_show(min_tokens)}", "min_tokens")
    if max_tokens and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    logprobs = _logprobs(body, chat)
    logprobs_mode = _get(body, "logprobs_mode", (str,), "raw")
    if logprobs_mode not in ("raw", "processed"):
        raise bad_request(
            f"'logprobs_mode' must be 'raw' or 'processed', got {logprobs_mode!r}", "logprobs_mode"
        )
    echo = False if chat else _get(body, "echo", (bool,), False)
    presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True)
    structured = _response_format(body)
    if chat:
        tools = parse_tools(body)
        if tools is not None and tools.constrained:
            if structured is not None:
                raise bad_request(
                    "'response_format' cannot constrain the output when 'tool_choice' forces a tool call; "
                    "send one of them",
                    "response_format",
                )
            structured = tools.structured_output()
    else:
        for name_ in ("tools", "functions", "tool_choice"):
            if body.get(name_) is not None:
                raise bad_request(f"'{name_}' is a chat field: send it to /v1/chat/completions", name_)
    if max_tokens == 0:  # echo with max_tokens 0: score the prompt; one token is sampled and dropped
        max_tokens = 1
    max_tokens = max_tokens or default_max_tokens
    try:  # SamplingParams holds the rules of the engine itself (e.g. the seed must fit in 64 bits)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            n=best_of,
            logprobs=logprobs if logprobs is not None else (0 if best_of > n else None),
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            logprobs_mode=logprobs_mode,
            min_tokens=min(min_tokens, max_tokens or min_tokens),
            logit_bias=_logit_bias(body),
            structured_output=structured,
        )
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        raise bad_request(f"'{field_name}' {str(exc).split(' ', 1)[1]}", field_name) from exc


def _response_format(body: dict) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}.
    Whether the schema compiles is the engine's admission rule (a 400 naming response_format.json_schema)."""
    response_format = _get(body, "response_format", (dict,), None)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", source="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                '\'response_format.json_schema\' must be an object {"name": ..., "schema": {...}}',
                "response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(
                "'response_format.json_schema.schema' must be a JSON schema object",
                "response_format.json_schema",
            )
        return StructuredOutput("json_schema", json.dumps(schema), source="response_format.json_schema")
    raise bad_request(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {_show(kind)}",
        "response_format.type",
    )


def _common(body: dict, prompts: list, default_max_tokens: int | None, chat: bool) -> GenerationRequest:
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False) if options else False
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    user = _get(body, "user", (str,), None)
    priority = _get(body, "priority", (int,), 0)
    model = _get(body, "model", (str,), None)
    given = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    params = _sampling(body, default_max_tokens, chat)
    echo = not chat and body.get("echo") is True
    n = _get(body, "n", (int,), 1)
    return GenerationRequest(
        prompt=prompts[0],
        params=params,
        stream=stream,
        include_usage=include_usage,
        user=user,
        priority=priority,
        model=model,
        max_tokens_given=given,
        prompts=prompts,
        echo=echo,
        echo_only=echo and given and _max_tokens(body, True) == 0,
        n=n,
        best_of=params.n,
        logprobs_requested=body.get("logprobs") not in (None, False),
        tools=parse_tools(body) if chat else None,
    )


def parse_completion(body: dict, default_max_tokens: int = 16) -> GenerationRequest:
    """POST /v1/completions. `prompt` is a string, an array of token ids, or an array of either (a batch)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_token_id(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
        if not prompts:
            raise bad_request("'prompt' must not be empty", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(
                f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt"
            )
    else:
        raise bad_request(
            f"'prompt' must be a string, an array of token ids, or an array of those, got "
            f"{type(prompt).__name__}",
            "prompt",
        )
    for i, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 and one is prompt else f"prompt[{i}]"
        if isinstance(one, str):
            if not one:
                raise bad_request(f"'{where}' must not be empty", "prompt")
        elif isinstance(one, list):
            if not one:
                raise bad_request(f"'{where}' must not be empty", "prompt")
            if not all(_is_token_id(t) for t in one):
                raise bad_request(f"'{where}' must be a string or an array of token ids (integers)", "prompt")
        else:
            raise bad_request(
                f"'{where}' must be a string or an array of token ids, got {type(one).__name__}", "prompt"
            )
    return _common(body, prompts, default_max_tokens, chat=False)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}", f"{where}.role"
            )
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is understood by a text model
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise bad_request(
                        f'\'{where}.content[{j}]\' must be a text part {{"type": "text", '
                        f'"text": ...}}; this model reads text only',
                        f"{where}.content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if role == "assistant" and message.get("tool_calls"):
            content = _with_tool_calls(content, message["tool_calls"], where)
        if not isinstance(content, str):
            raise bad_request(
                f"'{where}.content' must be a string or an array of text parts", f"{where}.content"
            )
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _with_tool_calls(content, calls, where: str) -> str:
    """An assistant turn that called tools, written back in the syntax the model calls them in."""
    if not isinstance(calls, list):
        raise bad_request(f"'{where}.tool_calls' must be an array", f"{where}.tool_calls")
    text = content if isinstance(content, str) else ""
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f'\'{where}.tool_calls[{j}]\' must be {{"type": "function", "function": {{"name", '
                f'"arguments"}}}}',
                f"{where}.tool_calls",
            )
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # kept as the text the client sent
        call_text = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        text += ("\n" if text else "") + f"<tool_call>\n{call_text}\n</tool_call>"
    return text


def parse_chat(body: dict) -> tuple[GenerationRequest, list[dict]]:
    """POST /v1/chat/completions; the prompt is rendered from the messages by the caller."""
    messages = parse_messages(body)
    return _common(body, [""], None, chat=True), messages
