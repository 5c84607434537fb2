"""The contract the server relies on: a consumer that leaves aborts its request at once, whenever it leaves.

The HTTP-level test (test_disconnect_overload) shows it under random timing; these
pin the timings that raced: a request added and abandoned before the engine
thread's next iteration.
"""

from __future__ import annotations

import asyncio
import time

from runtime import AsyncEngine, SamplingParams


async def _idle(engine: AsyncEngine, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def test_abandoned_before_the_engine_thread_sees_it(offline_engine):
    bridge = AsyncEngine(offline_engine)
    outputs = bridge.generate("Hello there", SamplingParams(max_tokens=200, ignore_eos=True), "early-leaver")
    first = asyncio.create_task(outputs.__anext__())
    await asyncio.sleep(0.05)  # the add is queued; the engine thread has not started
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await outputs.aclose()  # the consumer left: the abort is queued behind the add
    bridge.start()  # one iteration sees both
    try:
        stats = await _idle(bridge)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["kv_usage"] == 0.0
    finally:
        await bridge.shutdown()


async def test_abandoned_mid_stream_frees_its_blocks(offline_engine):
    bridge = AsyncEngine(offline_engine)
    bridge.start()
    try:
        got = 0
        async for out in bridge.generate(
            "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True), "mid-leaver"
        ):
            got += len(out.new_token_ids)
            if got >= 3:
                break
        assert got >= 3
        stats = await _idle(bridge)
        assert stats["num_running"] == 0 and stats["kv_usage"] == 0.0
    finally:
        await bridge.shutdown()


async def test_a_stalled_reader_gets_coalesced_outputs_not_a_backlog(offline_engine):
    """While the consumer does not read, the engine's deltas wait for it; the next read hands them over as
    one delta, with nothing lost or repeated."""
    bridge = AsyncEngine(offline_engine)
    bridge.start()
    try:
        outputs = bridge.generate(
            "Once upon a time", SamplingParams(max_tokens=40, ignore_eos=True, temperature=0), "stalled"
        )
        first = await outputs.__anext__()  # the request is running
        while bridge.stats()["num_running"]:  # ...and the reader stalls until it is done
            await asyncio.sleep(0.05)
        rest = [out async for out in outputs]
        assert len(rest) == 1 and rest[0].finished
        assert len(first.new_token_ids) + len(rest[0].new_token_ids) == 40
        assert len(rest[0].new_token_times) == len(rest[0].new_token_ids)
        alone = offline_engine.generate(
            ["Once upon a time"], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
        )[0]
        assert first.new_token_ids + rest[0].new_token_ids == alone.token_ids
        assert first.new_text + rest[0].new_text == alone.text
    finally:
        await bridge.shutdown()
