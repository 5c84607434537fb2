"""Render a model's Jinja chat template the way transformers does.

Same environment settings (trim_blocks, lstrip_blocks, sandboxed, loop controls,
the `{% generation %}` tag), the same helpers (raise_exception, strftime_now,
tojson, dict, namespace) and the same variables (messages, tools, documents,
add_generation_prompt, bos/eos tokens), so a prompt renders byte-identically
(tests/runtime/test_chat_template.py compares real templates with transformers).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class NoChatTemplateError(ValueError):
    """The model has no chat template (a base model): it serves completions, not chat. The server answers
    a chat request with 400 and this message."""

    def __init__(self):
        super().__init__(
            "this model has no chat template (it is a base model), so it cannot take chat messages; "
            "send the text as a prompt to /v1/completions, or serve a model that has one"
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


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; rendering
    keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes (CPython internals), as transformers' does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """dict() for templates, without the class itself (no attribute access to its internals)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra,
) -> str:
    """Messages are [{"role": ..., "content": str}, ...]; raises ValueError naming what is wrong. The template
    sees `tools` and `documents` as None unless given, as under transformers."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    variables = {"tools": None, "documents": None, **extra}
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
