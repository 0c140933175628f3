"""Apps through `client.apps`, against a real server: one app deployed once
from a `file://` git repository made here (the suite's server runs with
--apps-allow-file-urls). The deployment fetches it, makes a real VM of
`base`, starts the app there and goes live when it answers; the app's host
name `{name}.localhost` then reaches it through the server. The app is a
stdlib Python web server (detected as `python`), so nothing is installed.

Each deployment that starts costs a VM (seconds to minutes under TCG): the
suite starts one (another fails at its fetch, before any VM). The other
tests use apps that are never deployed."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

import clade
from conftest import Server

#: App names are host names, unique on the server: each run has its own.
RUN = uuid.uuid4().hex[:6]
PORT = 8080

SERVER_PY = """\
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = 1


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({
            "version": VERSION,
            "path": self.path,
            "greeting": os.environ.get("GREETING"),
            "secret": os.environ.get("API_SECRET"),
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    port = int(os.environ["PORT"])
    print(f"serving version {VERSION} on {port}", flush=True)
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
"""


def git(repo: Path, *args: str) -> str:
    # No global configuration of this machine: an author of its own, no HOME.
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("app-repo")
    git(repo, "init", "-q", "-b", "main")
    (repo / "server.py").write_text(SERVER_PY)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "version 1")
    return repo


def app_get(server: Server, name: str, path: str = "/") -> httpx.Response:
    """A request to the app's host name, through the server."""
    return httpx.get(f"{server.url}{path}", headers={"Host": f"{name}.localhost:{server.port}"}, timeout=120)


def delete_if_present(client: clade.Clade, app_id: str) -> None:
    try:
        client.apps.delete(app_id)
    except clade.NotFoundError:
        pass


@pytest.fixture
def undeployed_app(client: clade.Clade) -> Iterator[clade.AppInfo]:
    """An app never deployed (no VM): for what needs only its record."""
    app = client.apps.create(f"sdk-idle-{RUN}", "https://example.test/shop.git", env={"GREETING": "hi"})
    yield app
    delete_if_present(client, app.id)


def test_an_app_deploys_from_git_answers_at_its_host_name_and_is_deleted(client: clade.Clade, server: Server, repo: Path) -> None:
    name = f"sdk-shop-{RUN}"
    app = client.apps.create(name, f"file://{repo}", port=PORT, env={"GREETING": "hello"})
    try:
        assert (app.status, app.port, app.git_branch, app.url, app.env) == ("created", PORT, "main", None, {"GREETING": "hello"})
        # A secret reaches the app but is never shown again.
        assert client.apps.set_env(app.id, "API_SECRET", "s3cret", secret=True) == clade.AppEnvSet(key="API_SECRET", secret=True, scope="all")
        listed = {v.key: v for v in client.apps.env(app.id)}
        assert (listed["API_SECRET"].value, listed["API_SECRET"].secret) == ("••••••••", True)
        assert (listed["GREETING"].value, listed["GREETING"].secret) == ("hello", False)
        assert "s3cret" not in repr(client.apps.get(app.id))

        started = time.monotonic()
        queued = client.apps.deploy(app.id, wait=False)
        assert (queued.status, queued.app_id, queued.git_ref) == ("queued", app.id, "main")
        lines = list(client.apps.deploy_logs(app.id, queued.id))
        took = time.monotonic() - started
        done = client.apps.deployment(app.id, queued.id)
        assert done.status == "live", (done.error, lines[-10:])
        # The stream had the log the deployment kept, line by line, and ended with it.
        assert lines == (done.build_logs or "").splitlines(), (lines[-5:], (done.build_logs or "")[-500:])
        assert "framework: python (detected)" in lines and any("serving version 1" in line for line in lines)
        assert lines[-1].startswith(f"live: {name} answers on port {PORT}")
        assert done.framework == "python" and done.git_commit == git(repo, "rev-parse", "HEAD") and done.sandbox_id
        assert client.apps.wait(app.id, done.id).id == done.id, "a deployment over is waited for at once"
        print(f"\nthe deployment went live in {took:.1f} s")

        got = client.apps.get(name)
        assert (got.id, got.status, got.active_deployment_id, got.sandbox_id) == (app.id, "live", done.id, done.sandbox_id)
        assert got.url == f"http://{name}.localhost:{server.port}"
        assert [d.id for d in client.apps.deployments(app.id)] == [done.id]
        answer = app_get(server, name, "/items?x=1")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"version": 1, "path": "/items?x=1", "greeting": "hello", "secret": "s3cret"}
        assert f"serving version 1 on {PORT}" in client.apps.runtime_logs(app.id)

        # A deployment that fails (here at its fetch, before any VM) raises
        # with its log, and the live one serves on; it is nothing to roll back to.
        with pytest.raises(clade.AppDeployError) as failed:
            client.apps.deploy(app.id, "no-such-branch")
        assert failed.value.deployment.status == "failed" and failed.value.error, failed.value
        assert "no-such-branch" in (failed.value.build_logs or ""), failed.value
        assert app_get(server, name).json()["version"] == 1
        assert client.apps.get(app.id).active_deployment_id == done.id
        with pytest.raises(clade.ConflictError, match="no earlier deployment is kept"):
            client.apps.rollback(app.id)
    finally:
        delete_if_present(client, app.id)

    assert app_get(server, name).status_code == 404, "a deleted app's host name answers nothing"
    with pytest.raises(clade.NotFoundError):
        client.apps.get(app.id)
    deadline = time.monotonic() + 60
    while done.sandbox_id in {s.id for s in client.sandboxes.list()}:
        assert time.monotonic() < deadline, f"the deleted app's sandbox {done.sandbox_id} is still there"
        time.sleep(1)


async def test_the_async_client_lists_gets_and_edits_an_apps_env(aclient: clade.AsyncClade, undeployed_app: clade.AppInfo) -> None:
    app = undeployed_app
    assert app.id in [a.id for a in await aclient.apps.list()]
    assert (await aclient.apps.get(app.name)).id == app.id, "an app is found by its name too"
    assert await aclient.apps.deployments(app.id) == []

    await aclient.apps.set_env(app.id, "TOKEN", "t0k", secret=True)
    imported = await aclient.apps.import_env(app.id, '# settings\nGREETING="hi there"\nexport MODE=prod\n')
    assert (imported.imported, imported.total) == (2, 3)
    await aclient.apps.unset_env(app.id, "MODE")
    env = {v.key: (v.value, v.secret, v.scope) for v in await aclient.apps.env(app.id)}
    assert env == {"GREETING": ("hi there", False, "all"), "TOKEN": ("••••••••", True, "all")}
    with pytest.raises(clade.NotFoundError):
        await aclient.apps.unset_env(app.id, "MODE")

    updated = await aclient.apps.update(app.id, keep_deployments=1, build_command="make")
    assert (updated.keep_deployments, updated.build_command, updated.status) == (1, "make", "created")
    with pytest.raises(clade.ConflictError, match="no live deployment"):
        await aclient.apps.rollback(app.id)


def test_a_bad_name_is_refused_and_another_workspace_sees_nothing(
    client: clade.Clade, other_client: clade.Clade, undeployed_app: clade.AppInfo
) -> None:
    with pytest.raises(clade.BadRequestError, match="invalid app name"):
        client.apps.create("Bad_Name", "https://example.test/shop.git")
    with pytest.raises(clade.BadRequestError, match="reserved"):
        client.apps.create("api", "https://example.test/shop.git")
    with pytest.raises(clade.NotFoundError):
        client.apps.get("app-nosuchthing")

    with pytest.raises(clade.NotFoundError):
        other_client.apps.get(undeployed_app.id)
    with pytest.raises(clade.NotFoundError):
        other_client.apps.env(undeployed_app.id)
    with pytest.raises(clade.NotFoundError):
        other_client.apps.deploy(undeployed_app.id, wait=False)
    assert undeployed_app.id not in [a.id for a in other_client.apps.list()]
    # Names are host names: another workspace cannot take one either.
    with pytest.raises(clade.ConflictError, match="taken"):
        other_client.apps.create(undeployed_app.name, "https://example.test/theirs.git")
