"""envd's Connect services in the binary protobuf codec. The E2B SDKs
speak JSON, but envd serves both codecs and other Connect clients default
to binary: here the SDK's own generated clients (`process_connect`,
`filesystem_connect`) on `connectrpc`'s default codec, with the SDK's
transport and headers, drive the shared sandbox: a server stream (Start,
its output and exit code), a client stream (StreamInput), unary calls
with int64, enum, map and Timestamp fields, an error code, and a request
that is not protobuf."""

from __future__ import annotations

import time
import uuid

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.api import proxy_to_config
from e2b.api.client_sync import get_pyqwest_transport
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.interceptors import build_interceptors
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from pyqwest import SyncClient

from test_commands import COMMAND_TIMEOUT

TIMEOUT_MS = COMMAND_TIMEOUT * 1000


def binary_client(client_class, sandbox):
    """The SDK's client of one envd service, as the SDK builds it but with
    connectrpc's default codec (binary protobuf) instead of the SDK's JSON."""
    config = sandbox.connection_config
    url = sandbox.envd_api_url
    transport = get_pyqwest_transport(proxy_to_config(config.proxy), http_version=config.http_version)
    return client_class(
        url,
        interceptors=build_interceptors(config, url),
        http_client=SyncClient(transport),
        send_compression=None,
        accept_compression=(),
        timeout_ms=TIMEOUT_MS,
    )


@pytest.fixture(scope="module")
def process(sandbox):
    return binary_client(process_connect.ProcessClientSync, sandbox)


@pytest.fixture(scope="module")
def filesystem(sandbox):
    return binary_client(filesystem_connect.FilesystemClientSync, sandbox)


def run(process, command: str, envs=None, stdin: bool = False):
    """Start's stream read to its end: (pid, stdout, stderr, EndEvent)."""
    request = process_pb.StartRequest(
        process=process_pb.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", command], envs=envs or {}),
        stdin=stdin,
    )
    pid, out, err, end = None, b"", b"", None
    for response in process.start(request):
        match response.event.event:
            case Oneof(field="start", value=start):
                pid = start.pid
            case Oneof(field="data", value=data):
                match data.output:
                    case Oneof(field="stdout", value=chunk):
                        out += chunk
                    case Oneof(field="stderr", value=chunk):
                        err += chunk
            case Oneof(field="end", value=ended):
                end = ended
    return pid, out, err, end


def test_a_command_streams_its_output_and_exit_code_in_binary(process):
    pid, out, err, end = run(process, "echo \"hello $GREETING\"; echo oops >&2; exit 3", envs={"GREETING": "binary"})
    assert pid and pid > 0
    assert (out, err) == (b"hello binary\n", b"oops\n")
    # exit_code is a sint32 (zigzag); a signal's -1 is tested below.
    assert (end.exit_code, end.exited, end.status) == (3, True, "exit status 3"), end
    _, _, _, killed = run(process, "kill -9 $$")
    assert (killed.exit_code, killed.exited) == (-1, False), killed


def test_input_streams_in_and_processes_are_listed_in_binary(process, sandbox):
    handle = sandbox.commands.run("cat", background=True, stdin=True, timeout=COMMAND_TIMEOUT)
    try:
        listed = process.list(process_pb.ListRequest())
        assert handle.pid in [info.pid for info in listed.processes], listed
        selector = process_pb.ProcessSelector(selector=Oneof("pid", handle.pid))

        def inputs():
            yield process_pb.StreamInputRequest(event=Oneof("start", process_pb.StreamInputRequest.StartEvent(process=selector)))
            for chunk in (b"one ", b"two\n"):
                data = process_pb.StreamInputRequest.DataEvent(input=process_pb.ProcessInput(input=Oneof("stdin", chunk)))
                yield process_pb.StreamInputRequest(event=Oneof("data", data))

        process.stream_input(inputs())
        process.send_input(process_pb.SendInputRequest(process=selector, input=process_pb.ProcessInput(input=Oneof("stdin", b"three\n"))))
        process.close_stdin(process_pb.CloseStdinRequest(process=selector))
        result = handle.wait()
        assert result.stdout == "one two\nthree\n", result
    finally:
        try:
            handle.kill()
        except Exception:
            pass


def test_files_are_made_stated_listed_and_moved_in_binary(process, filesystem):
    base = f"/tmp/binary-{uuid.uuid4().hex[:8]}"
    made = filesystem.make_dir(filesystem_pb.MakeDirRequest(path=base))
    assert (made.entry.path, made.entry.type) == (base, filesystem_pb.FileType.DIRECTORY), made
    # Past 4 GiB the size needs all of the int64.
    _, _, _, end = run(process, f"truncate -s 5G {base}/big && printf abc > {base}/small")
    assert end.exit_code == 0, end
    stat = filesystem.stat(filesystem_pb.StatRequest(path=f"{base}/big"))
    assert (stat.entry.name, stat.entry.size, stat.entry.type) == ("big", 5 << 30, filesystem_pb.FileType.FILE), stat
    assert stat.entry.permissions.startswith("-rw") and stat.entry.owner, stat
    modified = stat.entry.modified_time
    assert abs(modified.seconds - time.time()) < 24 * 3600, modified  # a Timestamp, not a string
    listed = filesystem.list_dir(filesystem_pb.ListDirRequest(path=base, depth=1))
    assert sorted(entry.name for entry in listed.entries) == ["big", "small"], listed
    moved = filesystem.move(filesystem_pb.MoveRequest(source=f"{base}/small", destination=f"{base}/renamed"))
    assert moved.entry.path == f"{base}/renamed", moved
    filesystem.remove(filesystem_pb.RemoveRequest(path=base))
    with pytest.raises(ConnectError) as missing:
        filesystem.stat(filesystem_pb.StatRequest(path=base))
    assert missing.value.code == Code.NOT_FOUND, missing.value


def test_a_request_that_is_not_protobuf_is_an_invalid_argument(sandbox):
    # The SDK's own client of envd's HTTP API: its transport, headers and token.
    envd = sandbox._envd_api
    # Field 1 (path) says 100 bytes follow; two do.
    answer = envd.post("/filesystem.Filesystem/Stat", content=b"\x0a\x64/a", headers={"Content-Type": "application/proto"})
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"].startswith("application/json"), answer.headers
    assert answer.json()["code"] == "invalid_argument", answer.json()
