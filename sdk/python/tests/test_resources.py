"""The workspace's resources: identity, API keys (and their expiry),
templates and their builds, volumes."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from datetime import datetime, timedelta, timezone

import pytest

import clade
from conftest import EXEC_TIMEOUT, Server


def test_me_names_the_key_and_workspace(client: clade.Clade) -> None:
    me = client.me()
    assert me.workspace.name == "default" and me.key.prefix.startswith("clade_")
    assert client.health().status == "ok" and client.version().name == "clade"


def test_keys_create_list_use_and_revoke(client: clade.Clade, server: Server) -> None:
    token = client.keys.create("sdk-test")
    assert token.token and token.label == "sdk-test"
    assert token.prefix in [k.prefix for k in client.keys.list()]
    with clade.Clade(api_key=token.token, api_url=server.url) as second:
        assert second.me().key.prefix == token.prefix
        client.keys.revoke(token.prefix)
        with pytest.raises(clade.AuthenticationError):
            second.me()


def _expire_in_the_database(server: Server, prefix: str) -> None:
    databases = list(server.data_dir.glob("*.db")) + list(server.data_dir.glob("*.sqlite*"))
    assert databases, f"no SQLite database in {server.data_dir}"
    with sqlite3.connect(databases[0]) as db:
        changed = db.execute("UPDATE api_keys SET expires_at = ? WHERE prefix = ?", (int(time.time() * 1000) - 1000, prefix)).rowcount
    assert changed == 1


def test_an_expired_key_is_refused_saying_so(client: clade.Clade, server: Server) -> None:
    token = client.keys.create("expiring", expires_in_days=1)
    assert token.token and token.expires_at
    expires_in = datetime.fromisoformat(token.expires_at.replace("Z", "+00:00")) - datetime.now(timezone.utc)
    assert timedelta(hours=23) < expires_in <= timedelta(days=1)
    listed = {k.prefix: k for k in client.keys.list()}
    assert listed[token.prefix].expires_at == token.expires_at
    with clade.Clade(api_key=token.token, api_url=server.url) as expiring:
        assert expiring.me().key.prefix == token.prefix
        # A day is too long to wait: the key's expiry is moved to the past.
        _expire_in_the_database(server, token.prefix)
        with pytest.raises(clade.AuthenticationError) as refused:
            expiring.me()
    assert refused.value.error == "unauthorized" and refused.value.detail and "expired" in refused.value.detail
    assert "expired" in str(refused.value)
    client.keys.revoke(token.prefix)


def test_a_key_without_expiry_has_none_and_an_expiry_out_of_range_is_refused(client: clade.Clade) -> None:
    forever = client.keys.create("forever")
    try:
        assert forever.expires_at is None
    finally:
        client.keys.revoke(forever.prefix)
    for days in (0, 3651):
        with pytest.raises(clade.BadRequestError, match="expires_in_days"):
            client.keys.create("bad-expiry", expires_in_days=days)


def test_templates_list_and_get(client: clade.Clade) -> None:
    names = [t.name for t in client.templates.list()]
    assert "base" in names
    base = client.templates.get("base")
    assert base.is_global and base.ready
    with pytest.raises(clade.NotFoundError):
        client.templates.get("no-such-template")


def test_a_dockerfile_build_streams_its_log_and_makes_a_template(client: clade.Clade) -> None:
    build = client.templates.build("sdk-built", dockerfile="FROM base\nRUN echo built-by-sdk > /built.txt\n", replace=True)
    assert build.id in [b.id for b in client.builds.list()]
    lines = list(client.builds.logs(build.id, follow=True))
    done = client.builds.wait(build.id, timeout=600)
    assert done.status == "done", f"build {done.status}: {done.error}\n" + "\n".join(lines[-20:])
    assert lines, "the build's log was empty"
    try:
        with client.sandboxes.create("sdk-built") as sb:
            assert sb.exec("cat /built.txt", timeout=EXEC_TIMEOUT).stdout == "built-by-sdk\n"
    finally:
        client.templates.delete("sdk-built")


def test_a_build_can_be_cancelled_and_publishes_nothing(client: clade.Clade) -> None:
    build = client.templates.build("sdk-cancelled", dockerfile="FROM base\nRUN sleep 600\n", replace=True)
    cancelled = client.builds.cancel(build.id)
    assert cancelled.id == build.id and cancelled.status == "failed" and "cancelled" in (cancelled.error or "")
    with pytest.raises(clade.ConflictError):
        client.builds.cancel(build.id)
    assert "sdk-cancelled" not in [t.name for t in client.templates.list() if t.ready]


async def test_an_interrupted_wait_cancels_its_build(aclient: clade.AsyncClade) -> None:
    build = await aclient.templates.build("sdk-interrupted", dockerfile="FROM base\nRUN sleep 600\n", replace=True)
    waiting = asyncio.create_task(aclient.builds.wait(build.id, poll_interval=0.2))
    await asyncio.sleep(1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    ended = await aclient.builds.get(build.id)
    assert ended.status == "failed" and "cancelled" in (ended.error or "")


def test_volumes_create_attach_resize_and_delete(client: clade.Clade) -> None:
    volume = client.volumes.create("sdk-vol", size_mb=32)
    try:
        assert volume.size_mb == 32 and "sdk-vol" in [v.name for v in client.volumes.list()]
        with client.sandboxes.create(volumes=[clade.VolumeAttachment(name="sdk-vol", mount_path="/mnt/data")]) as writer:
            # No `sync`: deleting the sandbox flushes its volumes.
            writer.exec("echo kept > /mnt/data/note", timeout=EXEC_TIMEOUT, check=True)
            attachments = client.volumes.get("sdk-vol").attachments
            assert [(a.sandbox_id, a.mode) for a in attachments] == [(writer.id, "rw")]
            with pytest.raises(clade.ConflictError):
                client.volumes.delete("sdk-vol")
        with client.sandboxes.create(volumes=[clade.VolumeAttachment(name="sdk-vol", mount_path="/mnt/data", read_only=True)]) as reader:
            assert reader.files.read_text("/mnt/data/note") == "kept\n"
            assert reader.exec("touch /mnt/data/x", timeout=EXEC_TIMEOUT).exit_code != 0
        assert client.volumes.resize("sdk-vol", 64).size_mb == 64
    finally:
        client.volumes.delete("sdk-vol")
    with pytest.raises(clade.NotFoundError):
        client.volumes.get("sdk-vol")
