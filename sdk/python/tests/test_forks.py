"""Forks, fork trees with a promoted winner, and snapshots."""

from __future__ import annotations

import uuid

import pytest

import clade
from conftest import EXEC_TIMEOUT


def test_fork_makes_children_that_carry_the_parents_state(client: clade.Clade) -> None:
    with client.sandboxes.create() as parent:
        parent.files.write("/root/state", "parent")
        children = parent.fork(count=2, metadata={"role": "child"})
        try:
            assert len(children) == 2 and len({c.id for c in children}) == 2
            for child in children:
                assert child.files.read_text("/root/state") == "parent"
                assert child.metadata["role"] == "child"
            children[0].files.write("/root/state", "changed")
            assert children[1].files.read_text("/root/state") == "parent"
        finally:
            for child in children:
                child.delete()


def test_fork_tree_and_promote_keep_the_winner_only(client: clade.Clade) -> None:
    with client.sandboxes.create() as parent:
        tree = parent.fork_tree(count=2)
        assert tree.errors == [] and len(tree.children) == 2 and tree.tree_id
        winner, loser = tree.children
        try:
            result = winner.promote(cleanup_siblings=True)
            assert result.winner == winner.id and loser.id in result.deleted
            assert winner.exec("echo won", timeout=EXEC_TIMEOUT).stdout == "won\n"
        finally:
            winner.delete()


def test_snapshot_and_create_from_it(client: clade.Clade) -> None:
    with client.sandboxes.create() as sb:
        sb.files.write("/root/saved", "in the snapshot")
        snap = sb.snapshot()
    try:
        assert snap.sandbox_id == sb.id
        assert client.snapshots.get(snap.id).id == snap.id
        assert snap.id in [s.id for s in client.snapshots.list()]
        assert [s.id for s in client.snapshots.list(sandbox_id=sb.id)] == [snap.id]
        with client.sandboxes.create(from_snapshot=snap.id) as restored:
            assert restored.info.from_snapshot == snap.id
            assert restored.files.read_text("/root/saved") == "in the snapshot"
    finally:
        client.snapshots.delete(snap.id)


def test_a_named_snapshot_is_found_and_used_by_its_name(client: clade.Clade) -> None:
    name = f"sdk-{uuid.uuid4().hex[:8]}"
    with client.sandboxes.create() as sb:
        sb.files.write("/root/saved", "named")
        snap = sb.snapshot(name=name)
        assert snap.name == name
        with pytest.raises(clade.ConflictError):
            sb.snapshot(name=name)
    try:
        assert [s.id for s in client.snapshots.list(name=name)] == [snap.id]
        assert client.snapshots.get(name).id == snap.id
        with client.sandboxes.create(from_snapshot=name) as restored:
            assert restored.info.from_snapshot == snap.id
            assert restored.files.read_text("/root/saved") == "named"
    finally:
        client.snapshots.delete(name)
    assert client.snapshots.list(name=name) == []
