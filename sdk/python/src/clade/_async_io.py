"""The few waits of the async client that are not a request: sleeping,
blocking file I/O, and work that must finish even if its task is cancelled.
`_sync_io` has the same names for the sync client, so `_sync.py` can be
generated from `_async.py` by dropping `async`/`await`."""

from __future__ import annotations

import asyncio
from asyncio import sleep
from typing import Any, Awaitable, Callable, Tuple, Type, TypeVar

T = TypeVar("T")

__all__ = ["INTERRUPTIONS", "run_blocking", "run_shielded", "sleep"]

#: What stops a wait from outside: Ctrl-C, or the task being cancelled.
INTERRUPTIONS: Tuple[Type[BaseException], ...] = (KeyboardInterrupt, asyncio.CancelledError)


async def run_blocking(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in a worker thread, so the event loop keeps running."""
    return await asyncio.to_thread(function, *args)


async def run_shielded(function: Callable[[], Awaitable[T]]) -> T:
    """`function()` to its end even if the awaiting task is cancelled."""
    return await asyncio.shield(function())
