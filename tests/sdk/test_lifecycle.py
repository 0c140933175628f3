"""Lifecycle (§3.7): the TTL and persistent settings, pause/resume,
hibernate/wake, and auto-wake of a hibernated sandbox on use."""

import pytest
from pandastack import BadRequestError, NotFoundError

from conftest import TEMPLATE, wait_for


def test_lifecycle_settings(fresh_sandbox):
    sb = fresh_sandbox
    lc = sb.lifecycle()
    assert isinstance(lc["ttl_seconds"], int) and lc["persistent"] is False and isinstance(lc["idle_seconds"], int)
    assert sb.set_ttl(900)["ttl_seconds"] == 900
    assert sb.lifecycle()["ttl_seconds"] == 900
    changed = sb.set_persistent(True)
    assert changed["persistent"] is True and sb.persistent is True
    assert sb.lifecycle() ["persistent"] is True
    with pytest.raises(BadRequestError):
        sb.set_ttl(-1)
    sb.set_persistent(False)


def test_pause_and_resume(fresh_sandbox):
    sb = fresh_sandbox
    sb.exec("echo kept > /root/state")
    sb.pause()
    assert sb.refresh().status == "paused"
    sb.resume()
    assert sb.refresh().status == "running"
    assert sb.exec("cat /root/state").stdout == "kept\n"


def test_hibernate_wake_and_auto_wake(fresh_sandbox):
    sb = fresh_sandbox
    # A process and a file: hibernation keeps memory and disk.
    sb.exec("echo on-disk > /root/f; nohup sleep 1000 >/dev/null 2>&1 & echo $! > /root/pid")
    pid = sb.exec("cat /root/pid").stdout.strip()

    sb.hibernate()
    assert sb.refresh().status == "hibernated"
    sb.wake()
    assert sb.refresh().status == "running"
    sb.wake()  # idempotent
    assert sb.exec(f"kill -0 {pid} && cat /root/f").stdout == "on-disk\n"

    # Auto-wake: any use of a hibernated sandbox wakes it first.
    sb.hibernate()
    assert sb.refresh().status == "hibernated"
    assert sb.exec(f"kill -0 {pid} && echo awake").stdout == "awake\n"
    assert sb.refresh().status == "running"

    sb.hibernate()
    assert sb.filesystem.read("/root/f") == b"on-disk\n"
    assert sb.refresh().status == "running"


def test_auto_resume_of_a_paused_sandbox(fresh_sandbox):
    sb = fresh_sandbox
    sb.pause()
    assert sb.exec("echo resumed").stdout == "resumed\n"
    assert sb.refresh().status == "running"


def test_the_idle_ttl_reaps_a_sandbox_but_not_a_persistent_one(client):
    """TTL is an idle TTL (§3.7): the reaper (every 30 s) deletes a sandbox
    idle longer than it; a persistent sandbox is exempt."""
    idle = client.sandboxes.create(template=TEMPLATE, ttl_seconds=1)
    kept = client.sandboxes.create(template=TEMPLATE, ttl_seconds=1, persistent=True)
    try:
        def reaped():
            try:
                client.sandboxes.get(idle.id)
                return False
            except NotFoundError:
                return True

        wait_for(reaped, timeout=90, interval=2, what="the reaper to delete the idle sandbox")
        assert client.sandboxes.get(kept.id).status in ("running", "hibernated")
    finally:
        for sb in (idle, kept):
            try:
                sb.kill()
            except NotFoundError:
                pass
