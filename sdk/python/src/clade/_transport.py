"""Sending a `Call`: building the request, retrying, and turning error
answers into errors. `BaseTransport` holds what the two clients' transports
share (`AsyncTransport` in `_async_transport`, `Transport` generated from it
in `_sync_transport`); they only wait and do I/O."""

from __future__ import annotations

from typing import Any, Dict, Optional

import httpx

from ._api import Call
from ._errors import APIConnectionError, APIStatusError, APITimeoutError, status_error
from ._retry import RetryPolicy, has_idempotency_key, may_resend, parse_retry_after
from ._settings import Settings

DEFAULT_TIMEOUT = 60.0
DEFAULT_CONNECT_TIMEOUT = 10.0
USER_AGENT = "clade-sdk-python"


class BaseTransport:
    def __init__(self, settings: Settings, *, timeout: float, retry: RetryPolicy) -> None:
        self.settings = settings
        self.timeout = timeout
        self.retry = retry

    def headers(self) -> Dict[str, str]:
        from . import __version__

        return {"Authorization": f"Bearer {self.settings.api_key}", "User-Agent": f"{USER_AGENT}/{__version__}"}

    def http_timeout(self, call: Call[Any]) -> httpx.Timeout:
        seconds = call.timeout if call.timeout is not None else self.timeout
        return httpx.Timeout(seconds, connect=min(seconds, DEFAULT_CONNECT_TIMEOUT))

    def url(self, call: Call[Any]) -> str:
        return self.settings.base_url + call.path

    def retry_delay_for_error(self, call: Call[Any], error: httpx.TransportError, retries_done: int, replayable: bool) -> Optional[float]:
        """How long to wait before resending after a connection error, or None.
        A connection never made is safe to retry for any request; one that
        broke after sending only for a request the server may see twice."""
        never_sent = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
        if not replayable or not (never_sent or may_resend(call.method, call.headers)):
            return None
        return self.retry.delay_for_connection_error(retries_done)

    def retry_delay_for_status(self, call: Call[Any], response: httpx.Response, retries_done: int, replayable: bool) -> Optional[float]:
        # A 429 or 503 is the server refusing before it did anything, except
        # an exec's 503 (the guest stopped answering during the command):
        # only requests that may be sent twice are retried. A 409 with
        # Retry-After on a keyed request is the server still answering the
        # first attempt: the retry gets that answer.
        if not replayable or not may_resend(call.method, call.headers):
            return None
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        return self.retry.delay_for_status(response.status_code, retry_after, retries_done, keyed=has_idempotency_key(call.headers))

    @staticmethod
    def connection_error(error: httpx.TransportError) -> APIConnectionError:
        if isinstance(error, httpx.TimeoutException):
            return APITimeoutError(f"the request timed out ({type(error).__name__}); the connection was closed")
        return APIConnectionError(f"connection to the server failed: {error or type(error).__name__}")

    @staticmethod
    def error_of(response: httpx.Response, content: bytes) -> APIStatusError:
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        return status_error(response.status_code, content, response.headers, retry_after)
