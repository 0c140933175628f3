"""Fork, fork-tree and promote (§3.9), and the SDK's explore() over them
(§4.5)."""

import pytest
import requests
from pandastack import Candidate, NotFoundError, PandastackError


def test_fork_copies_memory_and_disk(client, fresh_sandbox):
    parent = fresh_sandbox
    parent.exec("echo parent-disk > /root/f; nohup sleep 1000 >/dev/null 2>&1 & echo $! > /root/pid")
    child = parent.fork(metadata={"branch": "a"})
    try:
        assert child.id != parent.id and child.status == "running"
        assert child.metadata["fork_parent_id"] == parent.id
        assert child.metadata["branch"] == "a"
        pid = child.exec("cat /root/pid").stdout.strip()
        assert child.exec(f"kill -0 {pid} && cat /root/f").stdout == "parent-disk\n"
        # Copy-on-write: they diverge.
        child.exec("echo child > /root/f")
        assert parent.exec("cat /root/f").stdout == "parent-disk\n"
        assert client.sandboxes.get(child.id).metadata["fork_parent_id"] == parent.id
    finally:
        child.kill()


def test_fork_tree_and_promote_infers_the_tree(client, fresh_sandbox):
    parent = fresh_sandbox
    parent.exec("echo base > /root/f")
    children = parent.fork_tree(2, metadata={"run": "t"})
    ids = [c.id for c in children]
    try:
        assert len(children) == 2 and len(set(ids)) == 2 and parent.id not in ids
        tree_ids = {c.metadata.get("fork_tree_id") for c in children}
        assert len(tree_ids) == 1 and None not in tree_ids and "" not in tree_ids
        tree_id = tree_ids.pop()
        for i, child in enumerate(children):
            assert child.metadata["fork_parent_id"] == parent.id
            assert child.metadata["run"] == "t"
            assert child.status == "running"
            assert child.exec(f"cat /root/f && echo {i} > /root/f").stdout == "base\n"

        winner, loser = children
        # No tree_id: the server infers it from the winner's fork_tree_id.
        promoted = winner.promote(cleanup_siblings=True)
        assert promoted["winner"] == winner.id
        assert promoted["tree_id"] == tree_id
        assert promoted["deleted"] == [loser.id]
        assert not promoted.get("failures")
        with pytest.raises(NotFoundError):
            client.sandboxes.get(loser.id)
        assert winner.exec("cat /root/f").stdout == "0\n"
        assert parent.exec("cat /root/f").stdout == "base\n", "the parent is not a sibling"
    finally:
        for i in ids:
            try:
                client.sandboxes.delete(i)
            except NotFoundError:
                pass


def test_promote_without_cleanup_keeps_the_siblings(client, fresh_sandbox):
    children = fresh_sandbox.fork_tree(2)
    try:
        promoted = children[0].promote()
        assert promoted["winner"] == children[0].id and promoted["deleted"] == []
        assert client.sandboxes.get(children[1].id).status == "running"
    finally:
        for c in children:
            c.kill()


def test_explore_with_three_candidates(client, fresh_sandbox):
    parent = fresh_sandbox
    parent.exec("mkdir -p /work && echo 10 > /work/n")
    result = parent.explore(
        [
            Candidate.shell("fails", "exit 1"),
            Candidate.shell("doubles", "echo $(( $(cat /work/n) * 2 )) | tee /work/out"),
            Candidate.shell("triples", "echo $(( $(cat /work/n) * 3 )) | tee /work/out"),
        ],
        score_fn=lambda sb, o: float(o.stdout_tail.strip() or 0) if o.ok else 0.0,
        max_concurrency=3,
    )
    assert result.tree_id, "the children carry fork_tree_id metadata"
    assert result.winner_outcome.label == "triples"
    assert [o.label for o in result.outcomes] == ["triples", "doubles", "fails"]
    assert result.winner_outcome.files_changed == ["/work/out"]
    assert not result.errors, result.errors
    winner = result.winner
    try:
        assert winner.exec("cat /work/out").stdout == "30\n"
        losers = {o.sandbox_id for o in result.outcomes if o.label != "triples"}
        assert set(result.reaped) == losers
        for loser in losers:
            with pytest.raises(NotFoundError):
                client.sandboxes.get(loser)
        assert parent.exec("cat /work/n").stdout == "10\n"
    finally:
        winner.kill()


def test_promote_of_a_sandbox_in_no_tree_is_a_conflict(fresh_sandbox):
    for kwargs in ({}, {"cleanup_siblings": True}):
        with pytest.raises(PandastackError) as refused:
            fresh_sandbox.promote(**kwargs)
        assert "is not in a fork tree" in str(refused.value), refused.value


def test_fork_tree_lists_its_failed_children_as_errors(server, fresh_sandbox):
    # The shape PY's _children_from_fork_tree_response and OSS agree on: {children, errors: [{index, err}]}.
    answer = requests.post(
        f"{server.url}/v1/sandboxes/{fresh_sandbox.id}/fork-tree",
        json={"count": 2},
        headers={"Authorization": f"Bearer {server.admin_key}"},
        timeout=300,
    )
    assert answer.status_code == 201, answer.text
    tree = answer.json()
    try:
        assert tree["errors"] == [], tree["errors"]
        assert [c["metadata"]["fork_index"] for c in tree["children"]] == ["0", "1"]
    finally:
        for child in tree["children"]:
            requests.delete(f"{server.url}/v1/sandboxes/{child['id']}", headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=60)
