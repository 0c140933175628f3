"""What an upload can read from, and how it is sent without holding it in
memory: a local path, a binary file object, an iterable of bytes (or, for
the async client, an async iterable), or bytes.

A body that can be made again (bytes, a path, a seekable file) is resent
on a retry; an iterator cannot be, so its upload is not retried."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import IO, Any, AsyncIterable, AsyncIterator, Callable, Dict, Iterable, Iterator, Optional, Union

CHUNK_SIZE = 1 << 20

UploadSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes], Iterable[bytes]]
AsyncUploadSource = Union[UploadSource, AsyncIterable[bytes]]


@dataclass
class Body:
    #: Makes the body anew for each attempt.
    make: Callable[[], Any]
    replayable: bool
    headers: Dict[str, str]


def _length_headers(length: Optional[int]) -> Dict[str, str]:
    return {"Content-Length": str(length)} if length is not None else {}


def _file_chunks(file: IO[bytes]) -> Iterator[bytes]:
    while True:
        chunk = file.read(CHUNK_SIZE)
        if not chunk:
            return
        yield chunk


def _path_chunks(path: "Union[str, os.PathLike[str]]") -> Iterator[bytes]:
    with open(path, "rb") as file:
        yield from _file_chunks(file)


async def _async_path_chunks(path: "Union[str, os.PathLike[str]]") -> AsyncIterator[bytes]:
    file = await asyncio.to_thread(open, path, "rb")
    try:
        while True:
            chunk = await asyncio.to_thread(file.read, CHUNK_SIZE)
            if not chunk:
                return
            yield chunk
    finally:
        file.close()


async def _async_file_chunks(file: IO[bytes]) -> AsyncIterator[bytes]:
    while True:
        chunk = await asyncio.to_thread(file.read, CHUNK_SIZE)
        if not chunk:
            return
        yield chunk


async def _async_iter(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _seekable_start(file: IO[bytes]) -> Optional[int]:
    try:
        return file.tell() if file.seekable() else None
    except (OSError, ValueError):
        return None


def _remaining_length(file: IO[bytes], start: int) -> Optional[int]:
    try:
        end = os.fstat(file.fileno()).st_size
        return max(0, end - start)
    except (OSError, ValueError, AttributeError):
        return None


def upload_body(source: UploadSource) -> Body:
    """The request body that streams `source`, for the sync client."""
    return _body(source, asynchronous=False)


def async_upload_body(source: AsyncUploadSource) -> Body:
    """The request body that streams `source`, for the async client (file
    reads happen in a worker thread)."""
    return _body(source, asynchronous=True)


def _body(source: AsyncUploadSource, *, asynchronous: bool) -> Body:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return Body(lambda: data, True, {})
    if isinstance(source, (str, os.PathLike)):
        size = os.stat(source).st_size
        if asynchronous:
            return Body(lambda: _async_path_chunks(source), True, _length_headers(size))
        return Body(lambda: _path_chunks(source), True, _length_headers(size))
    if hasattr(source, "read"):
        file: IO[bytes] = source  # type: ignore[assignment]
        start = _seekable_start(file)
        length = _remaining_length(file, start) if start is not None else None

        def rewound() -> IO[bytes]:
            if start is not None:
                file.seek(start)
            return file

        if asynchronous:
            return Body(lambda: _async_file_chunks(rewound()), start is not None, _length_headers(length))
        return Body(lambda: _file_chunks(rewound()), start is not None, _length_headers(length))
    if hasattr(source, "__aiter__"):
        if not asynchronous:
            raise TypeError("an async iterable can only be uploaded with AsyncClade")
        chunks_async: AsyncIterable[bytes] = source  # type: ignore[assignment]
        return Body(lambda: chunks_async, False, {})
    if hasattr(source, "__iter__"):
        chunks: Iterable[bytes] = source
        if asynchronous:
            return Body(lambda: _async_iter(chunks), False, {})
        return Body(lambda: iter(chunks), False, {})
    raise TypeError(f"cannot upload a {type(source).__name__}: give a path, a binary file, bytes or an iterable of bytes")
