"""Snapshots (§3.8): snapshot a running sandbox, the /snapshots registry,
and create from a snapshot (memory, disk and processes come back)."""

import pytest
from pandastack import NotFoundError

from conftest import TEMPLATE


def test_snapshot_and_from_snapshot(client, other_client, fresh_sandbox):
    sb = fresh_sandbox
    sb.exec("echo snap-state > /root/s; nohup sleep 1000 >/dev/null 2>&1 & echo $! > /root/pid")
    snap_id = sb.snapshot()
    assert isinstance(snap_id, str) and snap_id
    # The source keeps running, and changes after the snapshot are its own.
    sb.exec("echo later > /root/s")

    snap = client.snapshots.get(snap_id)
    assert snap["id"] == snap_id and snap["sandbox_id"] == sb.id
    assert snap_id in [s["id"] for s in client.snapshots.list()]
    assert [s["id"] for s in client.snapshots.list(sandbox_id=sb.id)] == [snap_id]
    with pytest.raises(NotFoundError):
        other_client.snapshots.get(snap_id)
    assert snap_id not in [s["id"] for s in other_client.snapshots.list()]

    restored = client.sandboxes.create(template=TEMPLATE, from_snapshot=snap_id)
    try:
        assert restored.id != sb.id and restored.status == "running"
        assert restored.from_snapshot == snap_id
        assert restored.exec("cat /root/s").stdout == "snap-state\n"
        pid = restored.exec("cat /root/pid").stdout.strip()
        assert restored.exec(f"kill -0 {pid} && echo alive").stdout == "alive\n"
    finally:
        restored.kill()

    client.snapshots.delete(snap_id)
    with pytest.raises(NotFoundError):
        client.snapshots.get(snap_id)
    assert sb.exec("cat /root/s").stdout == "later\n"


def test_from_a_foreign_or_missing_snapshot_is_refused(client, other_client, fresh_sandbox):
    snap_id = fresh_sandbox.snapshot()
    try:
        with pytest.raises((NotFoundError,)):
            other_client.sandboxes.create(template=TEMPLATE, from_snapshot=snap_id)
        with pytest.raises(NotFoundError):
            client.sandboxes.create(template=TEMPLATE, from_snapshot="no-such-snapshot")
    finally:
        client.snapshots.delete(snap_id)
