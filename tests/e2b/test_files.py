"""Files through envd (`/files` for contents, the filesystem service for
the rest), in the shared sandbox: text and bytes both ways, list, exists,
get_info, rename, remove, make_dir, a directory watch, relative paths, an
8 MiB round trip, and signed URLs. Each test works under a directory of
its own."""

from __future__ import annotations

import hashlib
import io
import os
import urllib.error
import urllib.request
import uuid
from typing import Dict, Tuple

import pytest
from e2b import FileNotFoundException, FileType, FilesystemEventType

from conftest import REQUEST_TIMEOUT, CladeServer, wait_for


@pytest.fixture
def workdir() -> str:
    """A fresh directory (not made yet) in the user's home."""
    return f"/home/user/e2b-{uuid.uuid4().hex[:8]}"


def test_text_and_bytes_are_written_and_read_back(sandbox, workdir):
    written = sandbox.files.write(f"{workdir}/nested/hello.txt", "héllo\nworld\n")
    assert (written.name, written.path, written.type) == ("hello.txt", f"{workdir}/nested/hello.txt", FileType.FILE)
    assert sandbox.files.read(f"{workdir}/nested/hello.txt") == "héllo\nworld\n"

    every_byte = bytes(range(256)) * 4
    sandbox.files.write(f"{workdir}/bytes.bin", every_byte)
    assert sandbox.files.read(f"{workdir}/bytes.bin", format="bytes") == every_byte
    # What the guest sees is what was written.
    digest = sandbox.commands.run(f"sha256sum {workdir}/bytes.bin", timeout=REQUEST_TIMEOUT).stdout.split()[0]
    assert digest == hashlib.sha256(every_byte).hexdigest()

    # Writing again replaces; files are the default user's.
    sandbox.files.write(f"{workdir}/bytes.bin", b"short")
    assert sandbox.files.read(f"{workdir}/bytes.bin", format="bytes") == b"short"
    owner = sandbox.commands.run(f"stat -c %U {workdir}/nested/hello.txt", timeout=REQUEST_TIMEOUT).stdout
    assert owner == "user\n"

    # Compressed both ways (`Content-Encoding: gzip` up, `Accept-Encoding: gzip` down).
    sandbox.files.write(f"{workdir}/zipped.bin", every_byte * 64, gzip=True)
    assert sandbox.files.read(f"{workdir}/zipped.bin", format="bytes", gzip=True) == every_byte * 64

    with pytest.raises(FileNotFoundException):
        sandbox.files.read(f"{workdir}/missing.txt")


def test_a_directory_is_listed_and_its_entries_inspected_renamed_and_removed(sandbox, workdir):
    assert sandbox.files.make_dir(workdir) is True
    assert sandbox.files.make_dir(workdir) is False
    sandbox.files.write(f"{workdir}/a.txt", "12345")
    assert sandbox.files.make_dir(f"{workdir}/sub/deeper") is True

    entries = {entry.name: entry for entry in sandbox.files.list(workdir)}
    assert set(entries) == {"a.txt", "sub"}, entries
    assert entries["a.txt"].type == FileType.FILE and entries["a.txt"].size == 5
    assert entries["a.txt"].path == f"{workdir}/a.txt"
    assert entries["sub"].type == FileType.DIR
    deep = {entry.path for entry in sandbox.files.list(workdir, depth=2)}
    assert f"{workdir}/sub/deeper" in deep, deep

    info = sandbox.files.get_info(f"{workdir}/a.txt")
    assert (info.name, info.type, info.size, info.path) == ("a.txt", FileType.FILE, 5, f"{workdir}/a.txt")
    assert info.owner == "user" and info.permissions.startswith("-rw"), (info.owner, info.permissions)
    assert sandbox.files.get_info(workdir).type == FileType.DIR
    # A link is what it leads to, with where it leads.
    assert sandbox.commands.run(f"ln -s a.txt {workdir}/link").exit_code == 0
    linked = sandbox.files.get_info(f"{workdir}/link")
    assert (linked.name, linked.type, linked.symlink_target) == ("link", FileType.FILE, f"{workdir}/a.txt"), linked
    sandbox.files.remove(f"{workdir}/link")

    assert sandbox.files.exists(f"{workdir}/a.txt") is True
    assert sandbox.files.exists(f"{workdir}/nothing") is False

    renamed = sandbox.files.rename(f"{workdir}/a.txt", f"{workdir}/b.txt")
    assert (renamed.name, renamed.path) == ("b.txt", f"{workdir}/b.txt")
    assert not sandbox.files.exists(f"{workdir}/a.txt")
    assert sandbox.files.read(f"{workdir}/b.txt") == "12345"

    sandbox.files.remove(f"{workdir}/b.txt")
    assert not sandbox.files.exists(f"{workdir}/b.txt")
    sandbox.files.remove(f"{workdir}/sub")  # a directory with what is in it
    assert sandbox.files.list(workdir) == []

    with pytest.raises(FileNotFoundException):
        sandbox.files.list(f"{workdir}/nothing")
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(f"{workdir}/nothing")


def test_a_watch_sees_a_file_written_and_removed_in_its_directory(sandbox, workdir):
    sandbox.files.make_dir(workdir)
    watch = sandbox.files.watch_dir(workdir)
    seen = []

    def saw(kinds) -> bool:
        seen.extend(watch.get_new_events())
        return any(event.name == "new.txt" and event.type in kinds for event in seen)

    try:
        sandbox.files.write(f"{workdir}/new.txt", "watched")
        wait_for(lambda: saw({FilesystemEventType.CREATE, FilesystemEventType.WRITE}), timeout=60, interval=1,
                 what="a create or write event for new.txt")
        sandbox.files.remove(f"{workdir}/new.txt")
        wait_for(lambda: saw({FilesystemEventType.REMOVE}), timeout=60, interval=1, what="a remove event for new.txt")
    finally:
        watch.stop()


def test_relative_paths_are_in_the_users_home(sandbox):
    name = f"relative-{uuid.uuid4().hex[:8]}.txt"
    sandbox.files.write(name, "at home")
    assert sandbox.commands.run(f"cat /home/user/{name}", timeout=REQUEST_TIMEOUT).stdout == "at home"
    assert sandbox.files.read(name) == "at home"
    sandbox.files.remove(name)


def test_eight_mebibytes_go_both_ways_intact(sandbox, workdir):
    data = os.urandom(8 << 20)
    # A file object goes as a streamed octet-stream upload, bytes as multipart.
    sandbox.files.write(f"{workdir}/big.bin", io.BytesIO(data), request_timeout=300)
    sandbox.files.write(f"{workdir}/big-multipart.bin", data, request_timeout=300)
    sums = sandbox.commands.run(f"sha256sum {workdir}/big.bin {workdir}/big-multipart.bin", timeout=REQUEST_TIMEOUT)
    expected = hashlib.sha256(data).hexdigest()
    assert [line.split()[0] for line in sums.stdout.splitlines()] == [expected, expected]

    assert sandbox.files.read(f"{workdir}/big.bin", format="bytes", request_timeout=300) == data
    with sandbox.files.read(f"{workdir}/big-multipart.bin", format="stream", request_timeout=300) as stream:
        assert hashlib.sha256(b"".join(stream)).hexdigest() == expected
    sandbox.commands.run(f"rm -r {workdir}", timeout=REQUEST_TIMEOUT)


def fetch(server: CladeServer, url: str, headers: Dict[str, str], data: bytes = b"", method: str = "GET",
          ) -> Tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers, data=data or None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_signed_urls_read_and_write_without_the_token(server, sandbox, workdir):
    # With E2B_SANDBOX_URL the URL names no sandbox; the routing headers say
    # which, as the SDK's own requests do. The signature stands for the token.
    routing = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    sandbox.files.write(f"{workdir}/signed.txt", "signed content")

    url = sandbox.download_url(f"{workdir}/signed.txt", use_signature_expiration=600)
    assert url.startswith(server.url) and "signature=" in url, url
    assert fetch(server, url, routing) == (200, b"signed content")
    tampered = url.replace("signature=", "signature=x")
    assert fetch(server, tampered, routing)[0] in (401, 403)
    # A read signature does not sign another path.
    other = url.replace("signed.txt", "other.txt")
    assert fetch(server, other, routing)[0] in (401, 403)

    upload = sandbox.upload_url(f"{workdir}/uploaded.txt", use_signature_expiration=600)
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"uploaded.txt\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\nuploaded content\r\n--{boundary}--\r\n").encode()
    status, answer = fetch(server, upload, {**routing, "Content-Type": f"multipart/form-data; boundary={boundary}"},
                           data=body, method="POST")
    assert status == 200, answer
    assert sandbox.files.read(f"{workdir}/uploaded.txt") == "uploaded content"
