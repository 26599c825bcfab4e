"""Several async streams as one, items tagged with their stream's position, in arrival order."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator, TypeVar



T = TypeVar("T")


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's position.

    Leaving early (or one stream failing) cancels and closes every stream, which aborts their
    sequences in the core.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((position, item))
        except Exception as exc:
            queue.put_nowait((position, _Failed(exc)))
        finally:
            queue.put_nowait((position, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.exc
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge_tagged(streams: list[AsyncIterator[tuple[int, T]]]) -> AsyncIterator[tuple[int, T]]:
    """Merges streams whose items already carry their choice index."""
    async for _, tagged in merge(streams):
        yield tagged
