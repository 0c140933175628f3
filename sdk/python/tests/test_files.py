"""Files: bytes and streams both ways, any size, listing and metadata."""

from __future__ import annotations

import asyncio
import hashlib
import io
import random
import time
from pathlib import Path
from typing import AsyncIterator, Iterator, List

import pytest

import clade
from conftest import Server

MIB = 1 << 20
GIB = 1 << 30


def test_write_read_stat_list_and_remove(sandbox: clade.Sandbox) -> None:
    written = sandbox.files.write("/root/dir/hello.txt", "héllo\n")
    assert written.bytes == len("héllo\n".encode())
    assert sandbox.files.read("/root/dir/hello.txt") == "héllo\n".encode()
    binary = bytes(range(256)) * 4
    sandbox.files.write("/root/dir/blob.bin", binary)
    assert sandbox.files.read("/root/dir/blob.bin") == binary
    entry = sandbox.files.stat("/root/dir/blob.bin")
    assert (entry.size, entry.is_dir, entry.mode) == (1024, False, "f")
    assert [e.name for e in sandbox.files.list("/root/dir")] == ["blob.bin", "hello.txt"]
    sandbox.files.remove("/root/dir")
    assert not sandbox.files.exists("/root/dir")
    sandbox.files.remove("/root/dir")  # missing is fine
    with pytest.raises(clade.NotFoundError):
        sandbox.files.read("/root/dir/hello.txt")


def test_upload_from_a_path_a_file_object_and_an_iterable(sandbox: clade.Sandbox, tmp_path: Path) -> None:
    local = tmp_path / "in.bin"
    local.write_bytes(b"from a path")
    assert sandbox.files.upload(local, "/root/up/a").bytes == 11
    assert sandbox.files.upload(io.BytesIO(b"from a file object"), "/root/up/b").bytes == 18
    assert sandbox.files.upload(iter([b"from ", b"an ", b"iterable"]), "/root/up/c").bytes == 16
    assert [sandbox.files.read(f"/root/up/{n}") for n in "abc"] == [b"from a path", b"from a file object", b"from an iterable"]
    out = tmp_path / "out.bin"
    assert sandbox.files.download("/root/up/b", out) == 18
    assert out.read_bytes() == b"from a file object"
    sink = io.BytesIO()
    sandbox.files.download("/root/up/c", sink)
    assert sink.getvalue() == b"from an iterable"


class GaveUp(Exception):
    """The uploading program stops half-way."""


def _wait_until_only(sandbox: clade.Sandbox, directory: str, names: List[str]) -> None:
    """The directory holds just `names` (give the server a moment to drop
    what the aborted upload left)."""
    deadline = time.monotonic() + 5
    while True:
        listed = sorted(e.name for e in sandbox.files.list(directory))
        if listed == names or time.monotonic() > deadline:
            assert listed == names
            return
        time.sleep(0.5)


def test_an_upload_given_up_midway_replaces_nothing(sandbox: clade.Sandbox) -> None:
    sandbox.files.write("/root/abort/keep.txt", "the old contents\n")

    def chunks_then_give_up() -> Iterator[bytes]:
        for _ in range(8):
            yield b"x" * MIB
        raise GaveUp()

    with pytest.raises(GaveUp):
        sandbox.files.upload(chunks_then_give_up(), "/root/abort/keep.txt")
    _wait_until_only(sandbox, "/root/abort", ["keep.txt"])
    assert sandbox.files.read("/root/abort/keep.txt") == b"the old contents\n"


async def test_cancelling_an_async_upload_replaces_nothing(aclient: clade.AsyncClade, sandbox: clade.Sandbox) -> None:
    asandbox = await aclient.sandboxes.get(sandbox.id)
    await asandbox.files.write("/root/abort-async/keep.txt", "old")
    half_sent = asyncio.Event()

    async def chunks_then_stall() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"y" * MIB
        half_sent.set()
        await asyncio.sleep(3600)
        yield b"never"

    task = asyncio.create_task(asandbox.files.upload(chunks_then_stall(), "/root/abort-async/keep.txt"))
    await asyncio.wait_for(half_sent.wait(), 120)
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(_wait_until_only, sandbox, "/root/abort-async", ["keep.txt"])
    assert await asandbox.files.read("/root/abort-async/keep.txt") == b"old"


def _deterministic_chunks(total: int, digest: "hashlib._Hash") -> Iterator[bytes]:
    """`total` bytes made 1 MiB at a time (each chunk numbered, so that a
    lost or repeated chunk changes the hash), hashed as they go."""
    pattern = random.Random(2).randbytes(MIB)
    for index in range(total // MIB):
        chunk = index.to_bytes(8, "little") + pattern[8:]
        digest.update(chunk)
        yield chunk


def _server_peak_memory_mib(server: Server) -> float:
    """The server process's peak resident memory so far (VmHWM)."""
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def test_a_2_gib_file_round_trips_through_a_volume_keeping_the_servers_memory_flat(
    client: clade.Clade, server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    # Neither side holds the file: the test makes it chunk by chunk on the
    # way up and hashes it chunk by chunk on the way down; the server must
    # stream it too, which its peak memory shows.
    size = 2 * GIB
    volume = client.volumes.create("sdk-big", size_mb=3072)
    try:
        with client.sandboxes.create(volumes=[clade.VolumeAttachment(name=volume.name, mount_path="/data")]) as sb:
            peak_before = _server_peak_memory_mib(server)
            sent = hashlib.sha256()
            started = time.monotonic()
            written = sb.files.upload(_deterministic_chunks(size, sent), "/data/big", request_timeout=600)
            up_seconds = time.monotonic() - started
            assert written.bytes == size
            received, downloaded = hashlib.sha256(), 0
            started = time.monotonic()
            with sb.files.iter_chunks("/data/big", request_timeout=600) as chunks:
                for chunk in chunks:
                    downloaded += len(chunk)
                    received.update(chunk)
            down_seconds = time.monotonic() - started
            peak_after = _server_peak_memory_mib(server)
        with capsys.disabled():
            print(
                f"\n2 GiB round trip: up {size / MIB / up_seconds:.0f} MiB/s ({up_seconds:.1f} s), "
                f"down {size / MIB / down_seconds:.0f} MiB/s ({down_seconds:.1f} s); "
                f"server VmHWM {peak_before:.0f} MiB before, {peak_after:.0f} MiB after"
            )
        assert downloaded == size
        assert received.hexdigest() == sent.hexdigest()
        assert peak_after - peak_before < 200, f"the server's peak memory grew by {peak_after - peak_before:.0f} MiB"
    finally:
        client.volumes.delete(volume.name)


async def test_async_files_stream_both_ways(aclient: clade.AsyncClade, sandbox: clade.Sandbox, tmp_path: Path) -> None:
    asandbox = await aclient.sandboxes.get(sandbox.id)

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"async ", b"iterable"):
            yield part

    assert (await asandbox.files.upload(chunks(), "/root/async.txt")).bytes == 14
    assert await asandbox.files.read("/root/async.txt") == b"async iterable"
    local = tmp_path / "a.bin"
    local.write_bytes(b"x" * (3 * MIB + 5))
    assert (await asandbox.files.upload(local, "/root/async.bin")).bytes == 3 * MIB + 5
    got = b"".join([c async for c in asandbox.files.iter_chunks("/root/async.bin")])
    assert got == local.read_bytes()
    assert [e.name for e in await asandbox.files.list("/root") if e.name.startswith("async")] == ["async.bin", "async.txt"]

