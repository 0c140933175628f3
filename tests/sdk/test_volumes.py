"""Volumes (§3.12, issue 29) through the unmodified pandastack SDK: named
ext4 disks that outlive sandboxes, attached at create as /dev/vdb, …,
read-only when asked, one writer at a time, copied on write by forks,
durable across a server killed with SIGKILL, workspace-scoped."""

import uuid

import pytest
import requests
from pandastack import BadRequestError, NotFoundError, PandastackError

from conftest import TEMPLATE, kill_all


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def mount(sb, path: str = "/mnt/v", device: str = "/dev/vdb", options: str = "") -> None:
    """What the SDK's docs show: the guest mounts the disk itself (the
    SDK sends no mount_path)."""
    out = sb.exec(f"mkdir -p {path} && mount {options} {device} {path}")
    assert out.exit_code == 0, out.stderr


def status_of(error: PandastackError) -> int:
    return getattr(error, "status_code", None) or getattr(error, "status", None) or 0


def test_a_volume_outlives_its_sandbox_and_is_workspace_scoped(client, other_client):
    name = unique("data")
    created = client.volumes.create(name, 64)
    assert created["name"] == name and created["size_mb"] == 64
    assert name in [v["name"] for v in client.volumes.list()]
    assert client.volumes.get(name)["size_bytes"] == 64 << 20
    with pytest.raises(NotFoundError):
        other_client.volumes.get(name)
    assert name not in [v["name"] for v in other_client.volumes.list()]
    with pytest.raises(NotFoundError):
        other_client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
    # The other workspace may have a volume of the same name: its own.
    other_client.volumes.create(name, 32)
    try:
        writer = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
        try:
            assert writer.exec("cat /sys/block/vdb/size").stdout.strip() == str(64 << 11)
            mount(writer)
            assert writer.exec("echo persisted > /mnt/v/note && sync").exit_code == 0
            # Not synced by the guest: deleting the sandbox flushes it.
            assert writer.exec("echo unsynced > /mnt/v/late").exit_code == 0
            attached = client.volumes.get(name)["attachments"]
            assert [(a["sandbox_id"], a["mode"]) for a in attached] == [(writer.id, "rw")]
            with pytest.raises(PandastackError) as refused:
                client.volumes.delete(name)
            assert writer.id in str(refused.value)
        finally:
            writer.kill()

        reader = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
        try:
            mount(reader)
            assert reader.exec("cat /mnt/v/note").stdout == "persisted\n"
            assert reader.exec("cat /mnt/v/late").stdout == "unsynced\n"
        finally:
            reader.kill()
    finally:
        other_client.volumes.delete(name)
    assert other_client.volumes.list() == [] or name not in [v["name"] for v in other_client.volumes.list()]
    client.volumes.delete(name)
    with pytest.raises(NotFoundError):
        client.volumes.get(name)


def test_read_only_attachments_refuse_writes_and_one_writer_at_a_time(client):
    name = unique("shared")
    client.volumes.create(name, 32)
    try:
        seed = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
        try:
            mount(seed)
            seed.exec("echo dataset > /mnt/v/d && sync")
            with pytest.raises(PandastackError) as second:
                client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
            assert status_of(second.value) in (409, 0) and seed.id in str(second.value)
            with pytest.raises(PandastackError):
                client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name, "read_only": True}])
        finally:
            seed.kill()

        readers = [client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name, "read_only": True}]) for _ in range(2)]
        try:
            for reader in readers:
                mount(reader, options="-o ro")
                assert reader.exec("cat /mnt/v/d").stdout == "dataset\n"
                out = reader.exec("echo x > /mnt/v/new")
                assert out.exit_code != 0 and "Read-only file system" in out.stderr
                assert reader.exec("blockdev --getro /dev/vdb").stdout.strip() == "1"
            # Readers exclude a writer.
            with pytest.raises(PandastackError) as refused:
                client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
            assert readers[0].id in str(refused.value)
        finally:
            for reader in readers:
                reader.kill()
    finally:
        client.volumes.delete(name)


def test_fork_children_see_the_parent_data_and_not_each_others_writes(client):
    name = unique("forked")
    client.volumes.create(name, 32)
    parent = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
    children = []
    try:
        mount(parent)
        parent.exec("echo base > /mnt/v/base && sync")
        children = parent.fork_tree(2)
        parent.exec("echo later > /mnt/v/parent && sync")
        for i, child in enumerate(children):
            assert child.exec(f"echo {i} > /mnt/v/mine && sync").exit_code == 0
        for i, child in enumerate(children):
            out = child.exec("cat /mnt/v/base /mnt/v/mine; test -e /mnt/v/parent && echo leaked || echo private")
            assert out.stdout == f"base\n{i}\nprivate\n"
        assert parent.exec("test -e /mnt/v/mine && echo leaked || echo private").stdout == "private\n"
        modes = {a["sandbox_id"]: a["mode"] for a in client.volumes.get(name)["attachments"]}
        assert modes == {parent.id: "rw", children[0].id: "fork", children[1].id: "fork"}

        # Promote keeps the winner's volume: a later sandbox sees its state.
        children[1].promote(cleanup_siblings=True)
        modes = {a["sandbox_id"]: a["mode"] for a in client.volumes.get(name)["attachments"]}
        assert modes == {parent.id: "fork", children[1].id: "rw"}
        children[1].kill()
        parent.kill()
        after = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
        try:
            mount(after)
            out = after.exec("cat /mnt/v/base /mnt/v/mine; test -e /mnt/v/parent && echo parent || echo winner")
            assert out.stdout == "base\n1\nwinner\n"
        finally:
            after.kill()
    finally:
        for sb in [parent, *children]:
            try:
                sb.kill()
            except PandastackError:
                pass
        client.volumes.delete(name)


def test_bad_requests_are_refused_with_the_rule(client):
    for name, size, words in [("bad/name", 64, "invalid volume name"), ("ok-name", 70000, "max 65536"), ("ok-name", 1, "min 16")]:
        with pytest.raises(BadRequestError) as refused:
            client.volumes.create(name, size)
        assert words in str(refused.value)
    name = unique("dup")
    client.volumes.create(name, 16)
    try:
        with pytest.raises(PandastackError) as taken:
            client.volumes.create(name, 16)
        assert "already exists" in str(taken.value)
        with pytest.raises(BadRequestError):
            client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}, {"name": name}])
    finally:
        client.volumes.delete(name)


def test_quota_growth_and_a_killed_server_lose_nothing(start_server):
    server = start_server("volumes", env={"CLADE_MAX_VOLUMES": "2"})
    client = server.client()
    client.volumes.create("one", 32)
    client.volumes.create("two", 32)
    with pytest.raises(BadRequestError) as quota:
        client.volumes.create("three", 32)
    assert "quota" in str(quota.value)

    sb = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": "one"}])
    mount(sb)
    assert sb.exec("head -c 1048576 /dev/urandom > /mnt/v/blob && sha256sum /mnt/v/blob > /root/sum && sync").exit_code == 0
    digest = sb.exec("cat /root/sum").stdout.split()[0]
    # SIGKILL of the server and of the sandbox's QEMU, right after the
    # guest's sync: nothing has time to flush or unmount.
    server.kill()
    kill_all(server.vm_pids())
    server.start()
    client = server.client()
    assert client.sandboxes.get(sb.id).status == "failed"
    assert client.volumes.get("one")["attachments"] == [], "a failed sandbox holds no volume"
    resized = requests.patch(f"{server.url}/v1/volumes/one", json={"size_mb": 64},
                             headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=120)
    assert resized.status_code == 200, resized.text
    shrink = requests.patch(f"{server.url}/v1/volumes/one", json={"size_mb": 32},
                            headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=60)
    assert shrink.status_code == 400 and "never shrink" in shrink.json()["error"]

    again = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": "one"}])
    try:
        mount(again)
        assert again.exec("sha256sum /mnt/v/blob").stdout.split()[0] == digest
        size_kb = int(again.exec("df -k --output=size /mnt/v | tail -1").stdout.strip())
        assert size_kb > 48 * 1024, f"the filesystem did not grow: {size_kb} KiB"
    finally:
        again.kill()
    for name in ("one", "two"):
        client.volumes.delete(name)


def test_a_sandbox_made_from_a_snapshot_has_the_volume_as_of_the_snapshot(client):
    name = unique("snap")
    client.volumes.create(name, 32)
    source = client.sandboxes.create(template=TEMPLATE, volumes=[{"name": name}])
    restored = None
    try:
        mount(source)
        source.exec("echo at-snapshot > /mnt/v/state && sync")
        snap_id = source.snapshot()
        source.exec("echo after > /mnt/v/state && sync")
        restored = client.sandboxes.create(template=TEMPLATE, from_snapshot=snap_id)
        # Its memory has the mount; its disk is the volume as of the snapshot.
        assert restored.exec("cat /mnt/v/state").stdout == "at-snapshot\n"
        restored.exec("echo restored-only > /mnt/v/mine && sync")
        assert source.exec("cat /mnt/v/state; test -e /mnt/v/mine && echo leaked || echo private").stdout == "after\nprivate\n"
        modes = {a["sandbox_id"]: a["mode"] for a in client.volumes.get(name)["attachments"]}
        assert modes == {source.id: "rw", restored.id: "fork"}
        client.snapshots.delete(snap_id)
    finally:
        for sb in (source, restored):
            if sb is not None:
                try:
                    sb.kill()
                except PandastackError:
                    pass
        client.volumes.delete(name)
