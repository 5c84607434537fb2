"""Parse and validate OpenAI request bodies into what the engine needs.

Every check names the offending field; nothing here raises anything but
APIError, so a bad body can never turn into a 500.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler import SamplingParams
from server.errors import bad_request

_MISSING = object()
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class GenerationRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    priority: int
    model: str | None
    max_tokens_given: bool
    """False: generate up to the rest of the context (chat: max_tokens None) or 16 tokens (completions),
    as OpenAI does, lowered to what fits."""


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
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
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


def _sampling(body: dict, default_max_tokens: int | None) -> SamplingParams:
    max_tokens = _get(body, "max_completion_tokens", (int,), None) if "max_completion_tokens" in body else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), None)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{name}' must be at least 1, got {_show(max_tokens)}", name)
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
    if n != 1:
        raise bad_request(f"'n' must be 1 (one choice per request), got {_show(n)}", "n")
    best_of = _get(body, "best_of", (int,), 1)
    if best_of != 1:
        raise bad_request("'best_of' other than 1 is not supported", "best_of")
    presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True)
    for name_ in ("logprobs", "top_logprobs", "logit_bias", "tools", "functions", "response_format"):
        if body.get(name_) not in (None, False, 0, {}, []):
            raise bad_request(f"'{name_}' is not supported by this server", name_)
    if body.get("echo"):
        raise bad_request("'echo' is not supported by this server", "echo")
    try:   # SamplingParams holds the rules of the engine itself (e.g. the seed must fit in 64 bits)
        return SamplingParams(max_tokens=max_tokens or default_max_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
                              ignore_eos=ignore_eos, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        raise bad_request(f"'{field_name}' {str(exc).split(' ', 1)[1]}", field_name) from exc


def _common(body: dict, prompt, default_max_tokens: int | None) -> GenerationRequest:
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False) if options else False
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    user = _get(body, "user", (str,), None)
    priority = _get(body, "priority", (int,), 0)
    model = _get(body, "model", (str,), None)
    given = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    return GenerationRequest(prompt=prompt, params=_sampling(body, default_max_tokens), stream=stream,
                             include_usage=include_usage, user=user, priority=priority, model=model,
                             max_tokens_given=given)


def parse_completion(body: dict, default_max_tokens: int = 16) -> GenerationRequest:
    """POST /v1/completions. `prompt` is a string or an array of token ids (one prompt per request)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("'prompt' must be a string or an array of token ids; batches of several prompts "
                              "are not supported (send one request per prompt)", "prompt")
    else:
        raise bad_request(f"'prompt' must be a string or an array of token ids, got {type(prompt).__name__}",
                          "prompt")
    return _common(body, prompt, default_max_tokens)


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
            raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}",
                              f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):   # content parts: only text is understood by a text model
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", "
                                      f"\"text\": ...}}; this model reads text only", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string or an array of text parts", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_chat(body: dict) -> tuple[GenerationRequest, list[dict]]:
    """POST /v1/chat/completions; the prompt is rendered from the messages by the caller."""
    messages = parse_messages(body)
    return _common(body, "", None), messages
