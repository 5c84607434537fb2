"""A failing engine step fails its own requests with a 500 envelope; the engine keeps serving the rest.

The fault is injected (named so): the model runner raises whenever a marked prompt is in the step, standing in
for any bug or hardware fault inside a step. Everything else is real: the model, the engine thread, the aiohttp
app on loopback.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from runtime import AsyncEngine, EngineDeadError, RequestFailedError, SamplingParams
from server import build_app

POISON = [9991, 9992, 9993]
"""A prompt starting with these token ids makes the injected fault fire once the request has a first token
and ARMED is set (a streaming test sets it once its stream has started)."""
ARMED = threading.Event()


@pytest.fixture
def faulty_engine(offline_engine, monkeypatch):
    runner = offline_engine.runner
    real_execute = runner.execute

    def execute_with_injected_fault(plan):
        if ARMED.is_set() and any(
            req.prompt_token_ids[:3] == POISON and req.output_token_ids for req, _ in plan.scheduled
        ):
            raise RuntimeError("injected fault: secret detail that must not reach the client")
        return real_execute(plan)

    monkeypatch.setattr(runner, "execute", execute_with_injected_fault)
    ARMED.set()
    return offline_engine


async def _post(session, url, body):
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def test_failing_step_is_a_500_for_its_request_and_the_engine_keeps_serving(faulty_engine):
    server = TestServer(build_app(faulty_engine, throughput_log_seconds=60), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as session:
            status, body = await _post(
                session, url, {"prompt": POISON + [28, 29], "max_tokens": 3, "ignore_eos": True}
            )
            assert status == 500
            error = json.loads(body)["error"]
            assert error["code"] == "engine_error" and "RuntimeError" in error["message"]
            assert "secret detail" not in error["message"] and "request id" in error["message"].lower()

            # streaming: the stream ends with an error event, then [DONE]
            ARMED.clear()
            async with session.post(
                url + "/v1/completions",
                json={"prompt": POISON + [30], "max_tokens": 50, "stream": True, "ignore_eos": True},
            ) as resp:
                assert resp.status == 200
                events = []
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        ARMED.set()  # the stream has started: now let the fault fire
            assert events[-1] == b"[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_error"

            # the engine still serves, concurrently too, and is healthy
            results = await asyncio.gather(
                *(
                    _post(session, url, {"prompt": f"Count {i}:", "max_tokens": 4, "ignore_eos": True})
                    for i in range(4)
                )
            )
            assert [s for s, _ in results] == [200] * 4
            assert all(json.loads(b)["usage"]["completion_tokens"] == 4 for _, b in results)
            async with session.get(url + "/health") as resp:
                assert resp.status == 200
            stats = server.app["state"].client.stats()
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0
    finally:
        await server.close()


async def test_only_the_failing_steps_requests_fail(faulty_engine):
    """A request admitted after the failure is served; one already failed does not come back."""
    bridge = AsyncEngine(faulty_engine)
    bridge.start()
    try:
        with pytest.raises(RequestFailedError) as info:
            async for _ in bridge.generate(POISON, SamplingParams(max_tokens=5, ignore_eos=True), "poisoned"):
                pass
        assert "RuntimeError" in info.value.cause and info.value.delta.finished
        outs = [out async for out in bridge.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finished
        assert bridge.error is None and bridge.num_in_flight == 0
    finally:
        await bridge.shutdown()


async def test_request_arriving_while_the_engine_dies_gets_an_error(offline_engine, monkeypatch):
    """Item 6: a request queued in the same instant the engine thread dies is answered, never left waiting,
    and is not counted in flight. The death is injected in the scheduler (named so)."""
    bridge = AsyncEngine(offline_engine)
    died = asyncio.Event()
    loop = asyncio.get_running_loop()

    def broken_schedule():
        loop.call_soon_threadsafe(died.set)
        raise AssertionError("injected scheduler bug")

    monkeypatch.setattr(offline_engine.scheduler, "schedule", broken_schedule)
    bridge.start()
    try:
        first = asyncio.create_task(_drain(bridge.generate("Hello", SamplingParams(max_tokens=3))))
        await died.wait()
        late = [
            asyncio.create_task(_drain(bridge.generate(f"Late {i}", SamplingParams(max_tokens=3))))
            for i in range(20)
        ]
        results = await asyncio.wait_for(asyncio.gather(first, *late, return_exceptions=True), timeout=30)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert bridge.num_in_flight == 0
    finally:
        monkeypatch.undo()
        await bridge.shutdown()
        for request_id in list(
            offline_engine.outputs.tracked
        ):  # leave the shared engine clean for other tests
            offline_engine.abort_request(request_id)


async def _drain(outputs):
    return [out async for out in outputs]


async def test_a_request_whose_step_raises_fails_alone_and_its_batch_finishes(faulty_engine):
    """The step of a batch raises because of one request (the injected fault): the engine runs each of the
    batch's requests alone, fails the one whose own step raises, and the others finish with every token."""
    bridge = AsyncEngine(faulty_engine)
    bridge.start()
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        ARMED.clear()  # fire only once the whole batch is running together
        tasks = [asyncio.create_task(_drain(bridge.generate(f"Count {i}:", params))) for i in range(3)]
        poisoned = asyncio.create_task(_drain(bridge.generate(POISON + [40, 41], params, "poison-in-batch")))
        while faulty_engine.scheduler.num_running < 4:
            await asyncio.sleep(0.001)
        ARMED.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, poisoned, return_exceptions=True), 120)
        assert isinstance(results[-1], RequestFailedError), results[-1]
        for outs in results[:-1]:
            assert sum(len(o.new_token_ids) for o in outs) == 12 and outs[-1].finished, outs
            assert all(o.error is None for o in outs)
        assert bridge.error is None and bridge.num_in_flight == 0
    finally:
        await bridge.shutdown()
