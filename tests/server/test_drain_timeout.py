"""After --drain-timeout, what is still running is aborted for real: streams end with an error event and
[DONE], waiting clients get a 503 envelope, and the process exits 0 soon after (inside the k8s grace period).
The server runs the tiny model (SmolLM2's tokenizer, random weights): what it generates is not the point."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from tests.server.conftest import MODEL, Server

pytestmark = pytest.mark.slow  # real servers


def test_requests_outliving_the_drain_timeout_are_aborted_cleanly(tiny_model):
    server = Server(
        "--model", str(tiny_model), "--served-model-name", MODEL, "--drain-timeout", "2", dtype="auto"
    )
    try:

        async def stream(session):
            events = []
            async with session.post(
                server.url + "/v1/completions",
                json={"prompt": "An endless story:", "max_tokens": 4000, "ignore_eos": True, "stream": True},
            ) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
            return events

        async def wait_whole(session):
            async with session.post(
                server.url + "/v1/completions",
                json={"prompt": "Another endless story:", "max_tokens": 4000, "ignore_eos": True},
            ) as r:
                return r.status, await r.json()

        async def main():
            async with aiohttp.ClientSession() as session:
                tasks = [asyncio.create_task(stream(session)) for _ in range(2)]
                tasks.append(asyncio.create_task(wait_whole(session)))
                await asyncio.sleep(2.0)  # all running, streams have tokens
                server.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
                return results, time.monotonic() - sent

        (first, second, (status, body)), answered_after = asyncio.run(main())
        for events in (first, second):
            assert events[-1] == b"[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "shutdown" and "retry" in error["message"]
            assert any(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # tokens came before
        assert status == 503 and body["error"]["code"] == "shutdown"
        assert answered_after < 2 + 10
        assert server.proc.wait(timeout=30) == 0
        assert "drain timeout: aborted 3 requests" in server.output()
    finally:
        server.stop()
