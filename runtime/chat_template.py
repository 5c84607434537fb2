"""Render a model's Jinja chat template the way transformers does.

Same environment settings (trim_blocks, lstrip_blocks, sandboxed), the same
helpers (raise_exception, tojson) and the same variables (messages,
add_generation_prompt, bos/eos tokens), so a prompt renders byte-identically.
"""

from __future__ import annotations

import json
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


TOOLS_PROMPT = (
    "You can call functions to answer. These are the functions, one JSON signature per line, "
    "between <tools> and </tools>:\n<tools>\n{signatures}\n</tools>\n\n"
    "To call a function, reply with a JSON object holding its name and its arguments between "
    "<tool_call> and </tool_call>, like this:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)
"""How tools reach a model whose chat template has no `tools` variable (SmolLM2's has none): a system
message in the <tool_call> syntax the server parses back."""


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def with_tools(
    template: str | None, messages: list[dict], tools: list[dict] | None
) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for a request with tools: the template's own `tools`
    variable when it has one, else TOOLS_PROMPT in the system message (added first when there is none)."""
    if not tools:
        return messages, {}
    if template_takes_tools(template):
        return messages, {"tools": tools}
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = TOOLS_PROMPT.format(signatures=signatures)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=messages[0]["content"] + "\n\n" + prompt)
        return [first, *messages[1:]], {}
    return [{"role": "system", "content": prompt}, *messages], {}


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra,
) -> str:
    """Messages are [{"role": ..., "content": str}, ...]; raises ValueError naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    try:
        return _compile(template or DEFAULT_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
