"""Typed streams that close their connection: leaving the loop early,
`close()`, the end of a `with` block or garbage collection all end the
request, which stops the work on the server (a command is killed).

A stream wraps a generator that opens the request, yields None once the
answer has come, then yields the items. `Stream` (sync) runs it to that
None when made, so a refused request raises where the stream is made;
`AsyncStream` cannot wait in a constructor, so it does so on first use."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any, AsyncGenerator, Generator, Generic, Optional, Type, TypeVar

from ._sse import ServerSentEvent

T = TypeVar("T")

#: What a stream wraps (see above): `async def f() -> AsyncEvents[X]` in
#: `_async.py` becomes `def f() -> Events[X]` in the generated `_sync.py`.
AsyncEvents = AsyncGenerator[Optional[T], None]
Events = Generator[Optional[T], None, None]


def event_json(event: ServerSentEvent) -> Any:
    try:
        return json.loads(event.data)
    except ValueError:
        return {}


class Stream(Generic[T]):
    """An iterator over a live answer. The request is made when the stream
    is made (so its errors are raised there); iterate it once."""

    def __init__(self, generator: Events[T]) -> None:
        self._generator = generator
        opened = next(self._generator)
        assert opened is None

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        item = next(self._generator)
        assert item is not None
        return item

    def close(self) -> None:
        """Ends the request (and the work behind it, on the server)."""
        self._generator.close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    def __del__(self) -> None:
        self._generator.close()


class AsyncStream(Generic[T]):
    """An async iterator over a live answer. The request is made on first
    use (`async for`, or entering `async with`); iterate it once."""

    def __init__(self, generator: AsyncEvents[T]) -> None:
        self._generator = generator
        self._opened = False

    async def _open(self) -> None:
        if not self._opened:
            self._opened = True
            opened = await self._generator.__anext__()
            assert opened is None

    def __aiter__(self) -> AsyncStream[T]:
        return self

    async def __anext__(self) -> T:
        await self._open()
        item = await self._generator.__anext__()
        assert item is not None
        return item

    async def aclose(self) -> None:
        """Ends the request (and the work behind it, on the server)."""
        await self._generator.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        await self._open()
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        await self.aclose()
