"""Several engine streams (one per prompt of a batched request) read as one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from runtime import OutputDelta


async def merge(sources: list) -> AsyncIterator[tuple[int, OutputDelta]]:
    """(source index, delta) from several engine streams as they arrive; closing this closes them all
    (which aborts their requests)."""
    if len(sources) == 1:
        async with aclosing(sources[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, source) -> None:
        try:
            async with aclosing(source) as outs:
                async for out in outs:
                    await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
