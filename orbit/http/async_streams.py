"""Async-iterator plumbing of the HTTP layer: interleave the n choices' streams of a request
(`merge`), and close an iterator that may have no aclose (`close`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


async def close(iterator) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


_END = object()


@dataclass(frozen=True)
class _Failure:
    error: Exception


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async generators in arrival order. The first error is raised here;
    closing this generator (or that error) cancels the others, which closes them."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(s, queue)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _Failure):
                raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _pump(stream: AsyncIterator[T], queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            queue.put_nowait(item)
        queue.put_nowait(_END)
    except Exception as exc:  # noqa: BLE001 - forwarded to the reader, which raises it
        queue.put_nowait(_Failure(exc))
    finally:
        await stream.aclose()
