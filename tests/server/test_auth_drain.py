"""API keys map callers to tenants (and 401 otherwise); SIGTERM drains in-flight work and exits 0.

The keyed server runs the tiny model (SmolLM2's tokenizer, random weights): keys, billing and the drain are
the point, not what it generates. Its last test stops it."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest
from openai import AuthenticationError

from tests.server.conftest import MODEL, tiny_server, wait_idle

pytestmark = pytest.mark.slow  # real servers


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"sk-alpha": {"tenant": "alpha", "weight": 2}, "sk-beta": {"tenant": "beta"}}))
    with tiny_server(tiny_model, "--api-keys", str(keys), "--drain-timeout", "60") as server:
        yield server


def test_missing_and_wrong_keys_get_401(keyed_server):
    for key in ("sk-wrong", ""):
        client = keyed_server.openai_client(key or "x", default_headers={} if key else {"Authorization": ""})
        with pytest.raises(AuthenticationError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 401
        assert "API key" in info.value.body["message"]


def test_keys_bill_their_tenants(keyed_server):
    for key, tokens in (("sk-alpha", 5), ("sk-beta", 3)):
        client = keyed_server.openai_client(key)
        out = client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=tokens,
            extra_body={"ignore_eos": True},
            user="ignored-when-keys-are-set",
        )
        assert out.usage.completion_tokens == tokens
    m = wait_idle(keyed_server)
    prompt = out.usage.prompt_tokens
    assert m["prescient:tenant_service_tokens_total{tenant=alpha}"] == prompt + 5
    assert m["prescient:tenant_service_tokens_total{tenant=beta}"] == prompt + 3
    assert not any("ignored-when-keys-are-set" in k for k in m)
    # VTC divides the charge by the weight: alpha (weight 2) pays half per token...
    alpha = (prompt + 2 * 5) / 2
    assert m["prescient:tenant_virtual_counter{tenant=alpha}"] == pytest.approx(alpha)
    # ...and beta, arriving when nobody waits, starts from the counter of the tenant served last
    assert m["prescient:tenant_virtual_counter{tenant=beta}"] == pytest.approx(alpha + prompt + 2 * 3)


def test_tenant_labels_are_capped(server, client):
    for i in range(40):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, user=f"user-{i}")
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)  # no user: tenant "default"
    m = wait_idle(server)
    tenants = {
        k.split("tenant=")[1].rstrip("}") for k in m if k.startswith("prescient:tenant_service_tokens_total")
    }
    # 32 free-form names, then "other"; "default" (like API-key tenants) always keeps its own label
    assert len(tenants) <= 34 and {"other", "default"} <= tenants


def test_sigterm_drains_in_flight_requests_then_exits_zero(keyed_server):
    """Runs last: it stops the module's server."""
    server, auth = keyed_server, {"Authorization": "Bearer sk-alpha"}

    async def main():
        async with aiohttp.ClientSession(headers=auth) as session:

            async def long_one(i):
                async with session.post(
                    server.url + "/v1/completions",
                    json={"prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True},
                ) as r:
                    return r.status, await r.json()

            tasks = [asyncio.create_task(long_one(i)) for i in range(4)]
            deadline = time.monotonic() + 30
            while server.metrics()["prescient:num_requests_running{}"] < 4:  # they are running now
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), server.output()
                await asyncio.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:
                async with session.post(server.url + "/v1/completions", json={"prompt": "late"}) as r:
                    late = r.status
            except aiohttp.ClientError:
                late = "refused"
            return await asyncio.gather(*tasks), late

    results, late = asyncio.run(main())
    assert all(status == 200 and body["usage"]["completion_tokens"] == 400 for status, body in results)
    assert late in (503, "refused")
    assert server.proc.wait(timeout=60) == 0
    assert "draining: 4 requests in flight" in server.output()
