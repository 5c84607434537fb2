"""Error codes through the official openai client (sync and async): its exception classes expose the
envelope's string `code`, the `param` naming the field to change, and the `type`."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hi"}]


def _raises(cls, call):
    with pytest.raises(cls) as info:
        call()
    return info.value


def test_codes_and_params_of_bad_requests(client):
    cases = [
        (
            lambda: client.completions.create(model=MODEL, prompt="x", temperature=5),
            "invalid_value",
            "temperature",
        ),
        (
            lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"top_k": "many"}),
            "invalid_type",
            "top_k",
        ),
        (
            lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user"}]),
            "missing_required_parameter",
            "messages[0].content",
        ),
        (
            lambda: client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100_000),
            "context_length_exceeded",
            "max_tokens",
        ),
        (
            lambda: client.completions.create(model=MODEL, prompt="x", n=2, best_of=1),
            "invalid_value",
            "best_of",
        ),
    ]
    for call, code, param in cases:
        error = _raises(openai.BadRequestError, call)
        assert (error.code, error.param, error.type) == (code, param, "invalid_request_error"), error.body
        assert error.status_code == 400 and param in error.message, error.message


def test_unknown_model_is_404_model_not_found(client):
    error = _raises(
        openai.NotFoundError,
        lambda: client.chat.completions.create(model="gpt-17", messages=MSG, max_tokens=1),
    )
    assert (error.code, error.param, error.type) == ("model_not_found", "model", "not_found_error")
    assert MODEL in error.message


async def test_async_client_sees_the_same_codes(server):
    async with server.async_openai_client() as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True, top_p=0)
        assert (info.value.code, info.value.param) == ("invalid_value", "top_p")
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt=[], max_tokens=2)
        assert (info.value.code, info.value.param) == ("invalid_value", "prompt")
