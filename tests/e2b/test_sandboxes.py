"""Sandboxes through E2B's control plane: create with metadata and
environment variables, list by metadata, get_info, kill (and what the SDK
says about a sandbox that is gone), and the walls between workspaces and
between sandboxes: another workspace's key finds nothing, a wrong API key
or envd access token is refused."""

from __future__ import annotations

import datetime
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from typing import Dict, Tuple

import pytest
from e2b import (
    AuthenticationException, Sandbox, SandboxNotFoundException, SandboxNotRunningException, SandboxQuery, SandboxState,
)

from conftest import REQUEST_TIMEOUT, RUN, TEMPLATE, CladeServer, kill_quietly, list_all, new_sandbox


def envd_get(server: CladeServer, path: str, headers: Dict[str, str]) -> Tuple[int, str]:
    """One plain GET of envd's HTTP API at the server: its status and body."""
    request = urllib.request.Request(f"{server.url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_a_sandbox_is_created_with_metadata_and_envs_listed_by_metadata_and_killed(e2b, sandbox):
    created = new_sandbox(metadata={"purpose": "listed"}, envs={"FOO": "bar"})
    try:
        assert created.sandbox_id
        assert created.commands.run("echo $FOO").stdout == "bar\n"

        info = created.get_info()
        assert info.sandbox_id == created.sandbox_id
        assert info.metadata.get("purpose") == "listed" and info.metadata.get("run") == RUN, info.metadata
        assert info.state == SandboxState.RUNNING
        # E2B answers the template's id and its alias (`name`); either is the name asked for here.
        assert TEMPLATE in (info.template_id, info.name), (info.template_id, info.name)
        assert info.started_at <= info.end_at
        assert info.envd_version
        assert Sandbox.get_info(created.sandbox_id).sandbox_id == created.sandbox_id
        # Connecting to a running sandbox gives another handle on the same one, its envs included.
        again = Sandbox.connect(created.sandbox_id, request_timeout=REQUEST_TIMEOUT)
        assert again.sandbox_id == created.sandbox_id
        assert again.commands.run("echo $FOO").stdout == "bar\n"

        listed = list_all(SandboxQuery(metadata={"purpose": "listed", "run": RUN}))
        assert [s.sandbox_id for s in listed] == [created.sandbox_id], listed
        assert listed[0].metadata.get("purpose") == "listed"
        # The shared sandbox has this run's tag but not `purpose`.
        of_the_run = {s.sandbox_id for s in list_all(SandboxQuery(metadata={"run": RUN}))}
        assert {created.sandbox_id, sandbox.sandbox_id} <= of_the_run
        assert sandbox.sandbox_id in {s.sandbox_id for s in list_all()}
        running = list_all(SandboxQuery(metadata={"purpose": "listed", "run": RUN}, state=[SandboxState.RUNNING]))
        assert [s.sandbox_id for s in running] == [created.sandbox_id]
        assert list_all(SandboxQuery(metadata={"purpose": "nothing-has-this"})) == []
        # By template, and by start time.
        listed_query = {"metadata": {"purpose": "listed", "run": RUN}}
        assert [s.sandbox_id for s in list_all(SandboxQuery(**listed_query, template=TEMPLATE))] == [created.sandbox_id]
        assert list_all(SandboxQuery(**listed_query, template="code-interpreter")) == []
        hour = datetime.timedelta(hours=1)
        now = datetime.datetime.now(datetime.timezone.utc)
        assert [s.sandbox_id for s in list_all(SandboxQuery(**listed_query, started_after=now - hour))] == [created.sandbox_id]
        assert list_all(SandboxQuery(**listed_query, started_after=now + hour)) == []

        assert created.is_running()
        assert created.kill() is True
    except BaseException:
        kill_quietly(created.sandbox_id)
        raise

    # Gone: not listed, not found, and its envd says so.
    assert created.sandbox_id not in {s.sandbox_id for s in list_all()}
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(created.sandbox_id, request_timeout=REQUEST_TIMEOUT)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(created.sandbox_id, request_timeout=REQUEST_TIMEOUT)
    assert Sandbox.kill(created.sandbox_id, request_timeout=REQUEST_TIMEOUT) is False
    assert created.is_running() is False
    with pytest.raises(SandboxNotRunningException):
        created.commands.run("true")


def test_a_command_of_a_sandbox_killed_under_it_says_the_sandbox_is_gone(e2b):
    sandbox = new_sandbox(metadata={"purpose": "killed-mid-command"})
    try:
        handle = sandbox.commands.run("sleep 600", background=True, timeout=0)
        assert sandbox.kill() is True
    finally:
        kill_quietly(sandbox.sandbox_id)
    # As on E2B: the stream is cut with its sandbox, and the SDK, whose
    # health probe then finds the sandbox gone, says so (not an exit code,
    # not "unreachable, state unknown").
    with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
        handle.wait()


def test_metrics_are_read_in_the_guest_and_an_interval_without_now_has_none(e2b, other_key, sandbox):
    [metric] = sandbox.get_metrics(request_timeout=REQUEST_TIMEOUT)
    assert metric.cpu_count >= 1 and 0 <= metric.cpu_used_pct <= 100, metric
    assert 0 < metric.mem_used < metric.mem_total and 0 < metric.disk_used < metric.disk_total, metric
    now = datetime.datetime.now(datetime.timezone.utc)
    covering = sandbox.get_metrics(start=now - datetime.timedelta(minutes=1), end=now, request_timeout=REQUEST_TIMEOUT)
    assert len(covering) == 1 and abs(covering[0].timestamp.timestamp() - now.timestamp()) < 10, covering
    # No history is kept: an interval an hour ago has no sample.
    past = sandbox.get_metrics(start=now - datetime.timedelta(hours=1), end=now - datetime.timedelta(minutes=30),
                               request_timeout=REQUEST_TIMEOUT)
    assert past == []
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics(sandbox.sandbox_id, start=now - datetime.timedelta(hours=1), end=now - datetime.timedelta(minutes=30),
                            api_key=other_key, request_timeout=REQUEST_TIMEOUT)


def test_an_unknown_sandbox_is_not_found(e2b):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("sandbox-that-never-was", request_timeout=REQUEST_TIMEOUT)
    assert Sandbox.kill("sandbox-that-never-was", request_timeout=REQUEST_TIMEOUT) is False


def test_another_workspace_finds_nothing_of_this_one(e2b, other_key, sandbox):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sandbox.sandbox_id, api_key=other_key, request_timeout=REQUEST_TIMEOUT)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sandbox.sandbox_id, api_key=other_key, request_timeout=REQUEST_TIMEOUT)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(sandbox.sandbox_id, 60, api_key=other_key, request_timeout=REQUEST_TIMEOUT)
    assert Sandbox.kill(sandbox.sandbox_id, api_key=other_key, request_timeout=REQUEST_TIMEOUT) is False
    assert sandbox.sandbox_id not in {s.sandbox_id for s in list_all(api_key=other_key)}
    # Still there for its own workspace.
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"


def test_a_wrong_api_key_is_an_authentication_error(e2b):
    with pytest.raises(AuthenticationException):
        list_all(api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.create(template=TEMPLATE, api_key="e2b_" + "0" * 40, request_timeout=REQUEST_TIMEOUT)


def test_envd_wants_the_sandboxs_access_token(server, e2b, sandbox):
    token = sandbox._envd_access_token  # what create answered; the SDK sends it as X-Access-Token
    assert isinstance(token, str) and token
    routing = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    status, body = envd_get(server, "/envs", {**routing, "X-Access-Token": token})
    assert status == 200, body
    assert isinstance(json.loads(body), dict)
    for wrong in ({}, {"X-Access-Token": "0" * len(token)}):
        status, body = envd_get(server, "/envs", {**routing, **wrong})
        assert status == 401, (wrong, status, body)
    # Health needs no token (the SDK probes it after a failed request).
    assert envd_get(server, "/health", routing)[0] in (200, 204)


def test_hosts_name_a_sandbox_and_its_other_ports_are_its_own_servers(server, e2b, sandbox):
    """The data plane by host (`{port}-{id}.{domain}`) as well as by header,
    and a port other than envd's reaching the sandbox's own server; over
    TLS, HTTP/2 is offered by ALPN (the SDK's Connect calls use it)."""
    token = {"X-Access-Token": sandbox._envd_access_token}  # what the SDK sends on each envd call
    status, _ = envd_get(server, "/health", {"Host": f"49983-{sandbox.sandbox_id}.localhost", **token})
    assert status == 204
    status, body = envd_get(server, "/envs", {"Host": f"49983-{sandbox.sandbox_id}.localhost"})
    assert status == 401, body

    sandbox.files.write("/tmp/www/index.html", "served by the sandbox\n")
    sandbox.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www", background=True)
    by_header = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8000"}
    host = sandbox.get_host(8000)
    assert host == f"8000-{sandbox.sandbox_id}.localhost", host
    for headers in (by_header, {"Host": host}):
        deadline = time.monotonic() + 60
        while True:
            status, body = envd_get(server, "/index.html", headers)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (status, body) == (200, "served by the sandbox\n"), headers

    if server.url.startswith("https://"):
        context = ssl.create_default_context(cafile=str(server.ca_path))
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                assert tls.selected_alpn_protocol() == "h2"


def test_e2b_routes_clade_does_not_serve_answer_in_e2bs_shape(server, e2b):
    status, body = envd_get(server, "/templates/aliases/base", {"X-API-KEY": e2b})
    answer = json.loads(body)
    assert (status, answer["code"]) == (404, 404) and "does not serve" in answer["message"], body
