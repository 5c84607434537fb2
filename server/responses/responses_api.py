"""POST /v1/responses: OpenAI's Responses API, translated onto the chat path.

The body becomes a chat body (input items -> messages, instructions -> a system message,
max_output_tokens, text.format -> response_format, flat function tools -> chat tools), which the chat
path checks, renders and runs (server/openai/generation.py): sampling, tool prompts, grammars and tool-call
parsing are the chat path's own. The output is written as Responses output items (a message with
output_text, function_call items), whole or as the Responses event stream (response.created,
response.output_item.added, response.output_text.delta, response.function_call_arguments.delta, ...,
response.completed). A stored response's conversation (server/response_store.py) continues with
previous_response_id.
"""

from __future__ import annotations

from aiohttp import web

from server.auth import Tenant, check_key, user_tenant
from server.errors import APIError, bad_request
from server.openai.generation import Generation, Prepared, check_grammar, prepare_translated
from server.responses.response_writer import ResponseWriter
from server.schema.compat_fields import RESPONSES
from server.state import ServerState, off_loop, parse_json, read_body

NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
"""Chat fields -> the Responses fields they came from, for errors."""


async def responses(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))
    raw = await read_body(request)
    v, messages, prepared = await off_loop(len(raw), _prepare, state, raw, keyed)
    await check_grammar(prepared)
    gen = Generation(request, state, prepared, "resp_")
    writer = ResponseWriter(state, v, gen, prepared.req.tools)
    stream, failed = await gen.write_events(v["stream"], writer, lambda _, error: _send_error(writer, error))
    if failed:
        return stream
    out = gen.ordered[0].out
    if stream is None:
        await writer.feed(out.text, True)
    response = writer.response(out.finish_reason, gen.usage())
    if v["store"]:
        state.responses.put(prepared.tenant.name, gen.request_id, messages + [writer.assistant_message()])
    if stream is None:
        return web.json_response(response)
    await writer.send(f"response.{response['status']}", {"response": response})
    await stream.write_eof()
    return stream


async def _send_error(writer: ResponseWriter, error: APIError) -> None:
    body = error.body()["error"]
    await writer.send("error", {"code": body["code"], "message": body["message"], "param": body["param"]})


def _prepare(state: ServerState, raw: bytes, keyed: Tenant | None) -> tuple[dict, list[dict], Prepared]:
    """The body read, the conversation it continues (without instructions), and the prepared chat request."""
    v = RESPONSES.read(parse_json(raw))
    tenant = keyed or user_tenant(state.api_keys, v["user"])
    messages = []
    if v["previous_response_id"] is not None:
        messages = state.responses.get(tenant.name, v["previous_response_id"])
        if messages is None:
            raise bad_request(
                f"Previous response with id {v['previous_response_id']!r} not found: responses are kept "
                f"per API key for a while, and only with store: true",
                "previous_response_id",
                "previous_response_not_found",
            )
    messages += _input_messages(v["input"])
    system = [{"role": "system", "content": v["instructions"]}] if v["instructions"] else []
    body = {
        "model": v["model"],
        "messages": system + messages,
        "max_completion_tokens": v["max_output_tokens"],
        "temperature": v["temperature"],
        "top_p": v["top_p"],
        "seed": v["seed"],
        "user": v["user"],
        "response_format": _response_format((v["text"] or {}).get("format")),
    }
    if v["tools"]:
        body["tools"] = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None},
            }
            for t in v["tools"]
        ]
        choice = v["tool_choice"]
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
    elif v["tool_choice"] not in (None, "none"):
        raise bad_request("'tool_choice' needs 'tools': send the functions the model may call", "tool_choice")
    return v, messages, prepare_translated(state, body, tenant, NAMES)


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt.get("schema") is None:
        raise bad_request(
            "'text.format.schema' is required with type 'json_schema'",
            "text.format.schema",
            "missing_required_parameter",
        )
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]},
    }


def _input_messages(items) -> list[dict]:
    """Input items as chat messages: a function_call joins the assistant turn before it (or starts one), a
    function_call_output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type") or "message"
        if kind == "message":
            for name in ("role", "content"):
                if item.get(name) is None:
                    raise bad_request(f"'input[{i}].{name}' is required", f"input[{i}].{name}")
            content = item["content"]
            if isinstance(content, list):
                content = "".join(part.get("text") or "" for part in content)
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if item.get(name) is None:
                    raise bad_request(f"'input[{i}].{name}' is required", f"input[{i}].{name}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            for name in ("call_id", "output"):
                if item.get(name) is None:
                    raise bad_request(f"'input[{i}].{name}' is required", f"input[{i}].{name}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages
