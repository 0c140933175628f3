"""`_async_io`'s names for the sync client (see there): here a wait is
just a wait, and a call cannot be cancelled half-way."""

from __future__ import annotations

from time import sleep
from typing import Any, Callable, Tuple, Type, TypeVar

T = TypeVar("T")

__all__ = ["INTERRUPTIONS", "run_blocking", "run_shielded", "sleep"]

INTERRUPTIONS: Tuple[Type[BaseException], ...] = (KeyboardInterrupt,)


def run_blocking(function: Callable[..., T], *args: Any) -> T:
    return function(*args)


def run_shielded(function: Callable[[], T]) -> T:
    return function()
