"""The filesystem (§3.5): read, write, upload, download, listdir, stat,
exists, walk; binary-safe, parents created, a missing path a NotFoundError."""

import os

import pytest
from pandastack import FileInfo, NotFoundError


def test_write_and_read_text_and_bytes(sandbox):
    written = sandbox.filesystem.write("/tmp/sdk/hello.txt", "héllo\n")
    assert written["path"] == "/tmp/sdk/hello.txt" and written["bytes"] == len("héllo\n".encode())
    assert sandbox.filesystem.read("/tmp/sdk/hello.txt") == "héllo\n".encode()
    assert sandbox.exec("cat /tmp/sdk/hello.txt").stdout == "héllo\n"

    blob = bytes(range(256)) * 1024 + b"\x00\r\n\xff"
    assert sandbox.filesystem.write("/tmp/sdk/blob.bin", blob)["bytes"] == len(blob)
    assert sandbox.filesystem.read("/tmp/sdk/blob.bin") == blob
    assert sandbox.exec("stat -c %s /tmp/sdk/blob.bin").stdout.strip() == str(len(blob))


def test_write_creates_parent_directories(sandbox):
    sandbox.filesystem.write("/tmp/sdk/deep/er/still/f.txt", "x")
    assert sandbox.exec("cat /tmp/sdk/deep/er/still/f.txt").stdout == "x"


def test_write_of_nothing_makes_an_empty_file(sandbox):
    assert sandbox.filesystem.write("/tmp/sdk/empty", b"")["bytes"] == 0
    assert sandbox.filesystem.read("/tmp/sdk/empty") == b""


def test_upload_and_download(sandbox, tmp_path):
    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(300_000))
    assert sandbox.filesystem.upload(local, "/root/up.bin")["bytes"] == 300_000
    back = tmp_path / "down.bin"
    sandbox.filesystem.download("/root/up.bin", back)
    assert back.read_bytes() == local.read_bytes()


def test_read_of_a_missing_file_is_not_found(sandbox):
    with pytest.raises(NotFoundError):
        sandbox.filesystem.read("/tmp/sdk/no-such-file")


def test_listdir_and_stat(sandbox):
    sandbox.exec("rm -rf /tmp/ls && mkdir -p /tmp/ls/sub && printf 12345 > /tmp/ls/five && ln -s five /tmp/ls/link")
    entries = {e.name: e for e in sandbox.filesystem.listdir("/tmp/ls")}
    assert set(entries) == {"sub", "five", "link"}
    assert all(isinstance(e, FileInfo) for e in entries.values())
    assert entries["sub"].is_dir and entries["sub"].path == "/tmp/ls/sub" and entries["sub"].mode == "d"
    five = entries["five"]
    assert not five.is_dir and five.size == 5 and five.path == "/tmp/ls/five" and five.mode == "f"
    assert five.mtime > 1_600_000_000  # unix seconds
    assert entries["link"].mode == "l"

    st = sandbox.filesystem.stat("/tmp/ls/five")
    assert (st.name, st.path, st.is_dir, st.size) == ("five", "/tmp/ls/five", False, 5)
    assert sandbox.filesystem.stat("/tmp/ls/sub").is_dir
    assert sandbox.filesystem.listdir("/tmp/ls/sub") == []


def test_stat_and_listdir_of_a_missing_path_are_not_found(sandbox):
    with pytest.raises(NotFoundError):
        sandbox.filesystem.stat("/tmp/nope")
    with pytest.raises(NotFoundError):
        sandbox.filesystem.listdir("/tmp/nope")


def test_exists(sandbox):
    sandbox.filesystem.write("/tmp/sdk/exists", "y")
    assert sandbox.filesystem.exists("/tmp/sdk/exists")
    assert sandbox.filesystem.exists("/tmp")
    assert not sandbox.filesystem.exists("/tmp/sdk/does-not")


def test_walk(sandbox):
    sandbox.exec("rm -rf /tmp/walk && mkdir -p /tmp/walk/a/b /tmp/walk/c && touch /tmp/walk/top /tmp/walk/a/one /tmp/walk/a/b/two")
    walked = {d: (sorted(x.name for x in dirs), sorted(f.name for f in files))
              for d, dirs, files in sandbox.filesystem.walk("/tmp/walk")}
    assert walked == {
        "/tmp/walk": (["a", "c"], ["top"]),
        "/tmp/walk/a": (["b"], ["one"]),
        "/tmp/walk/a/b": ([], ["two"]),
        "/tmp/walk/c": ([], []),
    }


def test_a_relative_path_is_a_bad_request(sandbox):
    from pandastack import BadRequestError

    with pytest.raises(BadRequestError):
        sandbox.filesystem.read("relative/path")
