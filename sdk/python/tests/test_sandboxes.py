"""Sandboxes: create, look up, scope-exit cleanup, lifecycle, events, logs,
ports and previews, network and limits."""

from __future__ import annotations

import pytest

import clade
from conftest import EXEC_TIMEOUT


def test_create_get_list_and_delete(client: clade.Clade) -> None:
    sb = client.sandboxes.create("base", metadata={"owner": "sdk"}, ttl_seconds=600, limits=clade.LimitsInfo(max_processes=300))
    try:
        assert sb.status == "running" and sb.info.template == "base" and sb.metadata["owner"] == "sdk"
        assert client.sandboxes.get(sb.id).info.ttl_seconds == 600
        assert sb.id in [s.id for s in client.sandboxes.list()]
        assert sb.limits.get().max_processes == 300
        assert sb.update(preview_auth=True).preview_auth is True
    finally:
        sb.delete()
    with pytest.raises(clade.NotFoundError):
        client.sandboxes.get(sb.id)


def test_a_sandbox_is_deleted_at_the_end_of_its_block_even_after_an_error(client: clade.Clade) -> None:
    with client.sandboxes.create() as sb:
        assert sb.exec("true", timeout=EXEC_TIMEOUT).exit_code == 0
    with pytest.raises(clade.NotFoundError):
        client.sandboxes.get(sb.id)
    with pytest.raises(RuntimeError, match="boom"):
        with client.sandboxes.create() as failing:
            raise RuntimeError("boom")
    with pytest.raises(clade.NotFoundError):
        client.sandboxes.get(failing.id)


def test_a_persistent_sandbox_outlives_its_block(client: clade.Clade) -> None:
    with client.sandboxes.create(persistent=True) as sb:
        pass
    try:
        assert client.sandboxes.get(sb.id).info.persistent
    finally:
        sb.delete()


async def test_async_sandbox_is_deleted_at_the_end_of_its_block(aclient: clade.AsyncClade) -> None:
    async with await aclient.sandboxes.create("base") as sb:
        assert (await sb.exec("echo hi", timeout=EXEC_TIMEOUT)).stdout == "hi\n"
    with pytest.raises(clade.NotFoundError):
        await aclient.sandboxes.get(sb.id)


def test_lifecycle_pause_resume_hibernate_wake_and_policy(client: clade.Clade) -> None:
    with client.sandboxes.create() as sb:
        sb.exec("echo kept > /root/state", timeout=EXEC_TIMEOUT)
        sb.pause()
        assert sb.refresh().status == "paused"
        sb.resume()
        assert sb.hibernate() == "hibernated"
        assert sb.wake() == "running"
        assert sb.files.read_text("/root/state") == "kept\n"
        # Disk only: the wake boots the disk, the files stay.
        boot_id = sb.files.read_text("/proc/sys/kernel/random/boot_id")
        assert sb.hibernate(memory=False) == "hibernated"
        assert sb.wake() == "running"
        assert sb.files.read_text("/proc/sys/kernel/random/boot_id") != boot_id
        assert sb.files.read_text("/root/state") == "kept\n"
        assert sb.get_lifecycle().hibernate_memory is True
        assert sb.set_lifecycle(hibernate_memory=False).hibernate_memory is False
        settings = sb.set_lifecycle(ttl_seconds=900)
        assert settings.ttl_seconds == 900 and sb.get_lifecycle().ttl_seconds == 900
        settings = sb.set_lifecycle(persistent=True, hibernate_after_seconds=120)
        assert (settings.persistent, settings.hibernate_after_seconds, settings.ttl_seconds) == (True, 120, 900)
        sb.set_lifecycle(persistent=False)
        kinds = [event.type for event in sb.events()]
        assert kinds[0] == "created" and "hibernated" in kinds and "woken" in kinds
        assert [event.payload.get("memory") for event in sb.events() if event.type == "hibernated"] == [True, False]


def test_stop_and_start(client: clade.Clade) -> None:
    with client.sandboxes.create() as sb:
        assert sb.stop() in ("hibernated", "stopped")
        assert sb.start() == "running"
        assert sb.exec("echo back", timeout=EXEC_TIMEOUT).stdout == "back\n"


def test_events_stream_and_logs(client: clade.Clade, sandbox: clade.Sandbox) -> None:
    with sandbox.stream_events(tail=5) as events:
        first = next(events)
    assert first.sandbox_id == sandbox.id
    assert isinstance(sandbox.logs(), str)
    assert isinstance(sandbox.logs(stream="stderr"), str)
    with sandbox.stream_logs(stream="stdout") as lines:
        del lines  # opening the stream is what is checked: it answers 200 and closes


def test_ports_previews_and_tokens(sandbox: clade.Sandbox) -> None:
    port = sandbox.ports.add(8000, label="web")
    assert port.port == 8000 and port.label == "web"
    listed = {p.port: p for p in sandbox.ports.list()}
    assert listed[8000].preview_url == sandbox.preview_url(8000)
    token = sandbox.preview_token(8000, ttl_seconds=60)
    assert token.token and token.port == 8000
    sandbox.ports.remove(8000)
    assert 8000 not in [p.port for p in sandbox.ports.list()]


def test_network_policy_get_and_set(sandbox: clade.Sandbox) -> None:
    status = sandbox.network.set(internet=False, allow_cidrs=["203.0.113.0/24"])
    assert status.policy is not None and status.policy.internet is False
    assert sandbox.network.get().policy == status.policy
    sandbox.network.set(clade.NetworkPolicy())


def test_limits_get_and_set(sandbox: clade.Sandbox) -> None:
    assert sandbox.limits.set(max_processes=512).max_processes == 512
    assert sandbox.limits.get().max_processes == 512
