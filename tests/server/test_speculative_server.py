"""--speculative-config through the real server: streamed deltas carry several tokens, usage counts what
was sent, the spec_decode metrics count the verifications, and a bad config is refused by field."""

from __future__ import annotations

import json

import pytest

from server.cli import engine_config, parse_args
from tests.server.conftest import MODEL, running_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TEXT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"

pytestmark = pytest.mark.slow


def test_bad_speculative_configs_name_the_field():
    assert engine_config(
        parse_args(["--speculative-config", json.dumps(NGRAM)])
    ).speculative.speculative_config
    for text, field in [
        ('{"method": "eagle9"}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram", "lookahead": 3}', "speculative_config.lookahead"),
        ("{method: ngram}", "speculative_config: not JSON"),
        ('{"method": "draft_model"}', "speculative_config.model"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine_config(parse_args(["--speculative-config", text]))


def test_stream_carries_several_tokens_per_delta_and_metrics_count_them():
    with running_server("--speculative-config", json.dumps(NGRAM)) as server:
        client = server.openai_client(timeout=120)
        prompt = f"Copy this list exactly: {TEXT}\nCopy: {TEXT[:30]}"
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        per_chunk, text, usage = [], "", None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs is not None:
                    per_chunk.append(len(choice.logprobs.tokens))
        assert sum(per_chunk) == usage.completion_tokens == 24
        assert max(per_chunk) > 1, "accepted proposals arrive together"
        whole = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        assert whole.choices[0].text == text and whole.usage.completion_tokens == 24
        m = server.metrics()
        drafts = m["prescient:spec_decode_num_drafts_total{}"]
        accepted = m["prescient:spec_decode_num_accepted_tokens_total{}"]
        assert drafts > 0 and 0 < accepted <= m["prescient:spec_decode_num_draft_tokens_total{}"]
        per_pos = [
            v for k, v in m.items() if k.startswith("prescient:spec_decode_num_accepted_tokens_per_pos")
        ]
        assert (
            sum(per_pos) == accepted
            and "prescient:spec_decode_num_accepted_tokens_per_pos_total{position=0}" in m
        )
