"""When and how long to wait before trying a request again.

Retried: connection errors (for a request that may be sent twice: safe
methods, or a POST with an Idempotency-Key; a connection that was never
made, for any request), 503, 429 with `Retry-After` (a 429 without it is
a quota that waiting does not change), and 409 with `Retry-After` on a
request with an Idempotency-Key (its first attempt is still being
answered). 507 and every other status are not.
Backoff is exponential with full jitter, at least what `Retry-After` says."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Mapping, Optional

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
DEFAULT_MAX_RETRIES = 2
#: A Retry-After longer than this is not waited for: the error is raised.
MAX_RETRY_AFTER = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = DEFAULT_MAX_RETRIES
    initial_delay: float = 0.5
    max_delay: float = 8.0

    def backoff(self, retries_done: int) -> float:
        """Exponential backoff with full jitter for the next attempt."""
        ceiling = min(self.max_delay, self.initial_delay * (2**retries_done))
        return random.uniform(ceiling / 2, ceiling)

    def delay_for_status(self, status: int, retry_after: Optional[float], retries_done: int, *, keyed: bool = False) -> Optional[float]:
        """Seconds to wait before retrying an answer of `status`, or None.
        `keyed`: the request carries an Idempotency-Key."""
        if retries_done >= self.max_retries:
            return None
        waiting_helps = status == 429 or (status == 409 and keyed)
        if status == 503 or (waiting_helps and retry_after is not None):
            if retry_after is None:
                return self.backoff(retries_done)
            return retry_after if retry_after <= MAX_RETRY_AFTER else None
        return None

    def delay_for_connection_error(self, retries_done: int) -> Optional[float]:
        if retries_done >= self.max_retries:
            return None
        return self.backoff(retries_done)


def has_idempotency_key(headers: Mapping[str, str]) -> bool:
    return any(name.lower() == "idempotency-key" for name in headers)


def may_resend(method: str, headers: Mapping[str, str]) -> bool:
    """Whether a request that may have reached the server can be sent again."""
    return method.upper() in SAFE_METHODS or has_idempotency_key(headers)


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """`Retry-After` in seconds (a number, or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
