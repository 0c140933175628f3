"""A client's transport (`AsyncTransport`): sends a `Call`, retrying as
`RetryPolicy` says, and reads server-sent events.

This is the async one; `_sync_transport.py` is generated from it by
scripts/generate_sync.py."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import httpx

from ._api import Call
from ._async_io import sleep
from ._retry import RetryPolicy
from ._settings import Settings
from ._sse import ServerSentEvent, SSEDecoder
from ._transport import BaseTransport

T = TypeVar("T")


class AsyncTransport(BaseTransport):
    def __init__(self, settings: Settings, *, timeout: float, retry: RetryPolicy, http: Optional[httpx.AsyncClient] = None) -> None:
        super().__init__(settings, timeout=timeout, retry=retry)
        self.http = http or httpx.AsyncClient(headers=self.headers(), follow_redirects=False)

    def with_options(self, *, timeout: Optional[float], max_retries: Optional[int]) -> AsyncTransport:
        retry = self.retry if max_retries is None else RetryPolicy(max_retries=max_retries)
        return AsyncTransport(self.settings, timeout=self.timeout if timeout is None else timeout, retry=retry, http=self.http)

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, call: Call[T], *, body: Optional[Callable[[], Any]] = None, replayable: bool = True) -> T:
        async with self.stream(call, body=body, replayable=replayable) as response:
            await response.aread()
            return call.parse(response)

    @contextlib.asynccontextmanager
    async def stream(self, call: Call[Any], *, body: Optional[Callable[[], Any]] = None, replayable: bool = True) -> AsyncIterator[httpx.Response]:
        """The answer, its body not read yet; closed on leaving the block
        (which ends the request, and the work behind it on the server).
        `body`, when given, makes the request's body anew for each attempt."""
        retries_done = 0
        while True:
            request = self.http.build_request(
                call.method, self.url(call), params=call.params, json=call.json, headers=call.headers,
                content=body() if body is not None else call.content, data=call.data, files=call.files,
                timeout=self.http_timeout(call),
            )
            try:
                response = await self.http.send(request, stream=True)
            except httpx.TransportError as e:
                delay = self.retry_delay_for_error(call, e, retries_done, replayable)
                if delay is None:
                    raise self.connection_error(e) from e
                await sleep(delay)
                retries_done += 1
                continue
            try:
                if response.is_success:
                    yield response
                    return
                delay = self.retry_delay_for_status(call, response, retries_done, replayable)
                content = await response.aread()
                if delay is None:
                    raise self.error_of(response, content)
            except httpx.TransportError as e:
                raise self.connection_error(e) from e
            finally:
                await response.aclose()
            await sleep(delay)
            retries_done += 1


async def async_sse_events(response: httpx.Response) -> AsyncIterator[ServerSentEvent]:
    """The events of a `text/event-stream` answer, as they come."""
    decoder = SSEDecoder()
    async for line in response.aiter_lines():
        event = decoder.feed(line)
        if event is not None:
            yield event
    last = decoder.flush()
    if last is not None:
        yield last
