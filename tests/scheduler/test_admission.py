"""The admission rule alone: room() and check() agree at every boundary, and refusals name the field."""

from __future__ import annotations

import pytest

from scheduler import AdmissionRule, InvalidRequestError, SchedulerConfig


@pytest.mark.parametrize("max_model_len, capacity", [(40, 1000), (1000, 32), (33, 32), (32, 32)])
def test_room_is_the_largest_max_tokens_admitted(max_model_len, capacity):
    rule = AdmissionRule(max_model_len, capacity)
    for p in range(1, min(max_model_len, capacity + 1)):
        room = rule.room(p)
        assert room >= 1
        rule.check(p, room)
        with pytest.raises(InvalidRequestError) as err:
            rule.check(p, room + 1)
        assert err.value.param == "max_tokens"
        assert rule.admit(p, None) == room
        assert rule.admit(p, 10**6, clamp=True) == room


def test_kv_bound_counts_the_last_token_once():
    rule = AdmissionRule(max_model_len=10**6, kv_capacity_tokens=32)
    rule.check(10, 23)  # 32 tokens hold KV; the 33rd is sampled, never fed back
    with pytest.raises(InvalidRequestError, match="at most 23") as err:
        rule.check(10, 24)
    assert err.value.param == "max_tokens"


def test_prompt_that_cannot_fit_names_prompt():
    rule = AdmissionRule(max_model_len=40, kv_capacity_tokens=1000)
    rule.check(39, 1)
    for p, m in ((40, 1), (41, 1)):
        with pytest.raises(InvalidRequestError) as err:
            rule.check(p, m)
        assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        AdmissionRule(max_model_len=100, kv_capacity_tokens=16).admit(17, 16, clamp=True)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        rule.check(0, 1)
    assert err.value.param == "prompt"


def test_scheduler_config_asks_the_same_rule():
    cfg = SchedulerConfig(num_blocks=4, block_size=4)
    assert cfg.admission == AdmissionRule(max_model_len=cfg.admission.max_model_len, kv_capacity_tokens=16)
    cfg.check_request(10, 7)
    with pytest.raises(InvalidRequestError):
        cfg.check_request(10, 8)
