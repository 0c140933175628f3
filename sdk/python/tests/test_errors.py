"""Errors: one class per status, carrying the server's message, detail and request id."""

from __future__ import annotations

import pytest

import clade
from conftest import Server


def test_an_unknown_sandbox_is_not_found_with_a_request_id(client: clade.Clade) -> None:
    with pytest.raises(clade.NotFoundError) as missing:
        client.sandboxes.get("doesnotexist")
    error = missing.value
    assert error.status_code == 404 and error.request_id and error.error
    assert error.request_id in str(error) and "404" in str(error)


def test_another_workspaces_sandbox_is_not_found(other_client: clade.Clade, sandbox: clade.Sandbox) -> None:
    with pytest.raises(clade.NotFoundError):
        other_client.sandboxes.get(sandbox.id)
    with pytest.raises(clade.NotFoundError):
        other_client.sandboxes.delete(sandbox.id)


def test_bad_input_is_a_bad_request(client: clade.Clade, sandbox: clade.Sandbox) -> None:
    with pytest.raises(clade.BadRequestError) as bad:
        sandbox.exec("   ")
    assert "cmd required" in bad.value.error
    with pytest.raises(clade.BadRequestError):
        client.sandboxes.create(metadata={"n": 1})  # type: ignore[dict-item]


def test_a_bad_key_is_an_authentication_error(server: Server) -> None:
    with clade.Clade(api_key="clade_not_a_key", api_url=server.url) as bad:
        with pytest.raises(clade.AuthenticationError) as refused:
            bad.me()
    assert refused.value.status_code == 401 and refused.value.error == "unauthorized"
    assert refused.value.detail


def test_deleting_a_global_template_is_permission_denied(client: clade.Clade) -> None:
    with pytest.raises(clade.PermissionDeniedError):
        client.templates.delete("base")


def test_an_unreachable_server_is_a_connection_error() -> None:
    with clade.Clade(api_key="k", api_url="http://127.0.0.1:9", max_retries=1) as unreachable:
        with pytest.raises(clade.APIConnectionError):
            unreachable.me()
