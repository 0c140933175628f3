"""API tokens (§3.17) and how the SDK finds the server and its key (§1.1,
§2.1): environment variables, the default client, a base URL ending in /v1."""

import pandastack
import pytest
from pandastack import AuthError, NotFoundError


def test_tokens_create_list_use_revoke(server, client):
    token = client.tokens.create("sdk-suite")
    assert token.token and token.prefix and token.token.startswith(token.prefix)
    assert token.name == "sdk-suite"
    assert token.prefix in [t.prefix for t in client.tokens.list()]

    fresh = server.client(token.token)
    assert fresh.me()["workspace"] == client.me()["workspace"]
    fresh.sandboxes.list()

    client.tokens.revoke(token.prefix)
    assert token.prefix not in [t.prefix for t in client.tokens.list()]
    with pytest.raises(AuthError):
        fresh.sandboxes.list()
    with pytest.raises(NotFoundError):
        client.tokens.revoke(token.prefix + "nope")


def test_tokens_of_another_workspace_are_not_listed_or_revocable(client, other_client):
    theirs = other_client.tokens.create("theirs")
    try:
        assert theirs.prefix not in [t.prefix for t in client.tokens.list()]
        with pytest.raises(NotFoundError):
            client.tokens.revoke(theirs.prefix)
    finally:
        other_client.tokens.revoke(theirs.prefix)


def test_the_default_client_from_the_environment(server, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.config/pandastack/config.json
    monkeypatch.setenv("PANDASTACK_API", server.url + "/")
    monkeypatch.setenv("PANDASTACK_API_KEY", server.admin_key)
    pandastack.set_default_client(None)
    try:
        assert isinstance(pandastack.Sandbox.list(), list)
        assert [t.prefix for t in pandastack.tokens.list()]
    finally:
        pandastack.set_default_client(None)


def test_a_config_file_and_a_base_url_ending_in_v1(server, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("PANDASTACK_API", raising=False)
    monkeypatch.delenv("PANDASTACK_API_KEY", raising=False)
    config = tmp_path / ".config" / "pandastack" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text('{"api_url": "%s/v1", "token": "%s"}' % (server.url, server.admin_key))
    client = pandastack.Client()
    assert client.api_url.endswith("/v1")
    assert isinstance(client.sandboxes.list(), list)
