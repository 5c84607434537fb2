"""Server-Sent Events framing as OpenAI streams it: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json

from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
        },
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


async def send_event(response: web.StreamResponse, event: str, payload: dict) -> None:
    """A named event (`event: NAME` then its data), as the Responses and Anthropic streams frame them."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    await response.write(b"event: " + event.encode() + b"\ndata: " + data + b"\n\n")
