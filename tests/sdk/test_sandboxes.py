"""Sandboxes: create, get, list, kill (§3.2), auth (§1) and workspace
isolation: another workspace's sandbox is a NotFoundError, exactly like a
missing one."""

import pandastack
import pytest
from pandastack import AuthError, NotFoundError

from conftest import TEMPLATE


def test_create_get_list_kill(client):
    sb = client.sandboxes.create(template=TEMPLATE, metadata={"purpose": "sdk-test"}, ttl_seconds=600)
    try:
        assert isinstance(sb, pandastack.Sandbox)
        assert sb.status == "running"
        assert sb.template == TEMPLATE
        assert sb.metadata["purpose"] == "sdk-test"
        assert isinstance(sb.cpu, int) and sb.cpu >= 1
        assert isinstance(sb.memory_mb, int) and sb.memory_mb >= 128
        assert sb.created_at and sb.boot_mode and isinstance(sb.boot_ms, int)
        assert sb.persistent is False

        got = client.sandboxes.get(sb.id)
        assert got.id == sb.id and got.status == "running" and got.metadata == sb.metadata

        assert sb.id in [s.id for s in client.sandboxes.list()]
        assert sb.refresh() is sb and sb.status == "running"
    finally:
        sb.kill()
    with pytest.raises(NotFoundError):
        client.sandboxes.get(sb.id)
    assert sb.id not in [s.id for s in client.sandboxes.list()]
    with pytest.raises(NotFoundError):
        sb.kill()


def test_persistent_is_echoed_and_the_context_manager_kills(client):
    with client.sandboxes.create(template=TEMPLATE, persistent=True) as sb:
        assert sb.persistent is True
        assert client.sandboxes.get(sb.id).persistent is True
        sb.set_persistent(False)
    # __exit__ kills a sandbox that is not persistent (any more).
    with pytest.raises(NotFoundError):
        client.sandboxes.get(sb.id)


def test_unknown_template_is_a_bad_request(client):
    with pytest.raises(pandastack.BadRequestError):
        client.sandboxes.create(template="no-such-template")


def test_templates_list_includes_base(client):
    names = [t.name for t in client.templates.list()]
    assert TEMPLATE in names


def test_another_workspace_sees_not_found(client, other_client, sandbox):
    with pytest.raises(NotFoundError):
        other_client.sandboxes.get(sandbox.id)
    # Every sandbox-scoped call through the other workspace's client is a 404.
    as_other = pandastack.Sandbox.from_dict({"id": sandbox.id}, client=other_client)
    with pytest.raises(NotFoundError):
        as_other.exec("true")
    with pytest.raises(NotFoundError):
        as_other.filesystem.read("/etc/hostname")
    with pytest.raises(NotFoundError):
        as_other.lifecycle()
    with pytest.raises(NotFoundError):
        as_other.kill()
    assert sandbox.id not in [s.id for s in other_client.sandboxes.list()]
    # ... and the sandbox is untouched.
    assert sandbox.exec("echo still-here").stdout == "still-here\n"


def test_a_missing_sandbox_is_not_found(client):
    with pytest.raises(NotFoundError):
        client.sandboxes.get("00000000-0000-0000-0000-000000000000")


def test_a_wrong_key_is_an_auth_error(server):
    bad = server.client("pds_" + "0" * 32)
    with pytest.raises(AuthError):
        bad.sandboxes.list()


def test_me_names_the_workspace(client):
    me = client.me()
    assert me.get("auth_method") == "token"
