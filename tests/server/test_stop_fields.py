"""stop_token_ids and ignore_eos over HTTP, through the official openai client (extra_body, as vLLM users
send them): a stop token ends the choice with finish_reason "stop" and names itself in stop_reason;
ignore_eos runs a reply that would end on its own to max_tokens."""

from __future__ import annotations

import pytest

from runtime import SamplingParams
from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow


def test_stop_token_ids_end_the_choice_and_name_the_token(client, offline_engine):
    prompt = "The three primary colors are"
    free = offline_engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)  # where greedy decoding first meets it
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert resp.usage.completion_tokens == first + 1  # the stop token is generated, then generation ends
    assert free.text.startswith(choice.text)


def test_ignore_eos_generates_past_the_end_of_turn(client):
    messages = [{"role": "user", "content": "Say hi."}]
    ended = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 48
    kept = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
    )
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 48
    assert kept.choices[0].message.content.startswith(ended.choices[0].message.content)
