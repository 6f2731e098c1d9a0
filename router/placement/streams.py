"""Merging async streams: the ingress merges its choices' streams, the router a group's migrated candidates."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence


async def merge_streams(streams: Sequence) -> AsyncIterator[tuple[int, object]]:
    """Every stream's items as they come, tagged by the stream's index; a failing stream's error is
    raised, and closing the merge closes every stream."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(streams))

    async def pump(i: int) -> None:
        try:
            async for item in streams[i]:
                await queue.put((i, item, None, False))
            await queue.put((i, None, None, True))
        except Exception as exc:
            await queue.put((i, None, exc, True))
        finally:
            await streams[i].aclose()

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc, ended = await queue.get()
            if exc is not None:
                raise exc
            if ended:
                remaining -= 1
            else:
                yield i, item
    finally:
        await cancel(tasks)


async def cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel the tasks and wait until they are done."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
