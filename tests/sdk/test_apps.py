"""Apps (issue 34) through the unmodified SDK's `client.apps`, against a
real server: each deployment fetches a real git repository (a `file://`
one made here: the suite's server runs with --apps-allow-file-urls), makes
a real VM of the app's template, starts the app there and goes live when
it answers; the app's host name `{name}.localhost` reaches it through the
server. The app is a stdlib Python web server (detected as `python`), so
nothing is downloaded.

The module's tests go in order on one app: deploy, redeploy, roll back,
fail without harm, delete.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pandastack
import pytest
import requests

from conftest import BIN, CladeServer

pytestmark = pytest.mark.timeout(900)

RUN = uuid.uuid4().hex[:6]
shared: Dict[str, object] = {}

SERVER = """\
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = {version}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{
            "version": VERSION,
            "path": self.path,
            "greeting": os.environ.get("GREETING"),
            "secret": os.environ.get("API_SECRET"),
            "git_token": os.environ.get("CLADE_GIT_TOKEN"),
        }}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    port = int(os.environ["PORT"])
    print(f"serving version {{VERSION}} on {{port}}", flush=True)
    {exit_now}
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
"""


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout.strip()


def commit(repo: Path, version: int, message: str, exit_now: bool = False) -> str:
    (repo / "server.py").write_text(SERVER.format(version=version, exit_now="sys.exit('no config: bye')" if exit_now else "pass"))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("app-repo")
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    (repo / "README.md").write_text("an app\n")
    commit(repo, 1, "version 1")
    return repo


def app_get(server: CladeServer, name: str, path: str = "/", timeout: float = 120) -> requests.Response:
    """A request to the app's host name, through the server."""
    return requests.get(f"{server.url}{path}", headers={"Host": f"{name}.localhost:{server.port}"}, timeout=timeout)


def deploy_and_follow(client: pandastack.Client, app_id: str, git_ref: Optional[str] = None) -> Dict:
    deployment = client.apps.deploy(app_id, git_ref=git_ref)
    assert deployment["status"] == "queued" and deployment["app_id"] == app_id
    lines: List[str] = list(client.apps.deploy_logs(app_id, deployment["id"]))
    done = client.apps.deployment(app_id, deployment["id"])
    assert done["status"] in ("live", "failed"), done
    # The stream had the log the deployment kept, line by line (the SDK strips each line).
    assert [line.strip() for line in lines] == [line.strip() for line in done["build_logs"].splitlines()], (lines[-5:], done["build_logs"][-500:])
    return done


@pytest.fixture(scope="module")
def app(client: pandastack.Client, repo: Path) -> Iterator[Dict]:
    app = client.apps.create(name=f"shop-{RUN}", git_url=f"file://{repo}", port=8080, env={"GREETING": "hello"})
    yield app
    try:
        client.apps.delete(app["id"])
    except pandastack.NotFoundError:
        pass


def test_an_app_deploys_from_git_and_answers_at_its_host_name(client: pandastack.Client, server: CladeServer, app: Dict) -> None:
    assert app["status"] == "created" and app["port"] == 8080 and app["git_branch"] == "main" and "url" not in app
    # A secret reaches the app and is never shown again; the git token is the deployment's, not the app's.
    assert client.apps.set_env(app["id"], "API_SECRET", "s3cret", secret=True) == {"key": "API_SECRET", "secret": True, "scope": "all"}
    client.apps.set_env(app["id"], "CLADE_GIT_TOKEN", "not-for-the-app", secret=True)
    listed = {e["key"]: e for e in client.apps.list_env(app["id"])}
    assert listed["API_SECRET"]["value"] == "••••••••" and listed["GREETING"]["value"] == "hello"
    assert "s3cret" not in json.dumps(client.apps.get(app["id"]))

    started = time.monotonic()
    done = deploy_and_follow(client, app["id"])
    took = time.monotonic() - started
    assert done["status"] == "live", done.get("error")
    assert done["framework"] == "python" and len(done["git_commit"]) == 40 and done["sandbox_id"]
    assert "framework: python (detected)" in done["build_logs"] and "serving version 1" in done["build_logs"]
    got = client.apps.get(app["id"])
    assert got["status"] == "live" and got["active_deployment_id"] == done["id"] and got["sandbox_id"] == done["sandbox_id"]
    assert got["url"] == f"http://shop-{RUN}.localhost:{server.port}"
    answer = app_get(server, f"shop-{RUN}", "/items?x=1")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body == {"version": 1, "path": "/items?x=1", "greeting": "hello", "secret": "s3cret", "git_token": None}
    print(f"\nfirst deployment live in {took:.1f} s")
    shared["first"] = done


def test_runtime_logs_and_an_env_import(client: pandastack.Client, server: CladeServer, app: Dict) -> None:
    logs = requests.get(f"{server.url}/v1/apps/{app['id']}/runtime-logs", headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=60)
    assert logs.status_code == 200 and "serving version 1 on 8080" in logs.text, logs.text
    imported = client.apps.import_env(app["id"], "# settings\nGREETING=\"hi there\"\nexport MODE=prod\n")
    assert imported == {"imported": 2, "total": 4}
    assert {e["key"]: e["value"] for e in client.apps.list_env(app["id"])}["GREETING"] == "hi there"


def test_a_new_deployment_goes_live_and_a_rollback_brings_the_last_one_back(
    client: pandastack.Client, server: CladeServer, app: Dict, repo: Path
) -> None:
    second_commit = commit(repo, 2, "version 2")
    done = deploy_and_follow(client, app["id"])
    assert done["status"] == "live" and done["git_commit"] == second_commit, done.get("error")
    body = app_get(server, f"shop-{RUN}").json()
    assert (body["version"], body["greeting"]) == (2, "hi there")
    first = shared["first"]
    statuses = {d["id"]: d["status"] for d in client.apps.deployments(app["id"])}
    assert statuses == {done["id"]: "live", first["id"]: "superseded"}  # type: ignore[index]

    started = time.monotonic()
    back = client.apps.rollback(app["id"])
    assert back["id"] == first["id"] and back["status"] == "live"  # type: ignore[index]
    while app_get(server, f"shop-{RUN}").json()["version"] != 1:
        assert time.monotonic() - started < 60, "the rollback did not take"
        time.sleep(0.1)
    print(f"\nrollback: the old deployment answered {time.monotonic() - started:.2f} s after the call")
    statuses = {d["id"]: d["status"] for d in client.apps.deployments(app["id"])}
    assert statuses == {done["id"]: "rolled_back", first["id"]: "live"}  # type: ignore[index]
    assert client.apps.get(app["id"])["active_deployment_id"] == first["id"]  # type: ignore[index]
    shared["second"] = done


def test_a_failed_build_or_start_leaves_the_live_deployment_serving(
    client: pandastack.Client, server: CladeServer, app: Dict, repo: Path
) -> None:
    client.apps.update(app["id"], build_command="echo building; exit 7")
    failed = deploy_and_follow(client, app["id"])
    assert failed["status"] == "failed" and "build failed (exit 7)" in failed["error"], failed
    assert "building" in failed["build_logs"] and "sandbox_id" not in failed
    assert app_get(server, f"shop-{RUN}").json()["version"] == 1
    client.apps.update(app["id"], build_command="")

    git(repo, "checkout", "-q", "-b", "broken")
    commit(repo, 3, "exits at once", exit_now=True)
    git(repo, "checkout", "-q", "main")
    crashed = deploy_and_follow(client, app["id"], git_ref="broken")
    assert crashed["status"] == "failed" and "exited before it answered" in crashed["error"], crashed
    assert "no config: bye" in crashed["build_logs"]
    assert app_get(server, f"shop-{RUN}").json()["version"] == 1
    assert client.apps.get(app["id"])["status"] == "live", "the app still serves its live deployment"


def test_bad_input_is_refused_with_the_reason(client: pandastack.Client, other_client: pandastack.Client, app: Dict) -> None:
    with pytest.raises(pandastack.NotFoundError):
        client.apps.get("app-nosuchthing")
    with pytest.raises(pandastack.NotFoundError):
        other_client.apps.get(app["id"])
    with pytest.raises(pandastack.NotFoundError):
        other_client.apps.deploy(app["id"])
    assert app["id"] not in [a["id"] for a in other_client.apps.list()]
    for name, url, why in [
        ("Bad_Name", "https://example.test/x.git", "invalid app name"),
        ("api", "https://example.test/x.git", "reserved"),
        (f"ok-{RUN}", "ext::sh -c id", "git_url"),
        (f"ok-{RUN}", "/srv/repo", "git_url"),
    ]:
        with pytest.raises(pandastack.BadRequestError, match=why):
            client.apps.create(name=name, git_url=url)
    with pytest.raises(pandastack.BadRequestError, match="taken"):
        other_client.apps.create(name=f"shop-{RUN}", git_url="https://example.test/x.git")
    with pytest.raises(pandastack.BadRequestError, match="git ref"):
        client.apps.deploy(app["id"], git_ref="--upload-pack=touch /tmp/x")
    with pytest.raises(pandastack.BadRequestError, match="variable name"):
        client.apps.set_env(app["id"], "1BAD", "x")
    fresh = client.apps.create(name=f"empty-{RUN}", git_url="https://example.test/x.git")
    try:
        with pytest.raises(pandastack.BadRequestError, match="no live deployment"):
            client.apps.rollback(fresh["id"])
    finally:
        client.apps.delete(fresh["id"])
    # What Clade does not have: a 501 that says so.
    with pytest.raises(pandastack.ServerError, match="pull-request previews"):
        client.apps.preview_repos()
    with pytest.raises(pandastack.ServerError, match="custom domains"):
        client.apps.add_domain(app["id"], "shop.example.test")


def test_an_auto_hibernating_app_sleeps_when_idle_and_the_next_request_wakes_it(
    client: pandastack.Client, server: CladeServer, repo: Path
) -> None:
    app = client.apps.create(name=f"nap-{RUN}", git_url=f"file://{repo}", port=9000)
    try:
        updated = client.apps.update(app["id"], auto_hibernate=True, idle_timeout_seconds=10)
        assert updated["auto_hibernate"] is True and updated["idle_timeout_seconds"] == 10
        done = deploy_and_follow(client, app["id"])
        assert done["status"] == "live", done.get("error")
        deadline = time.monotonic() + 120
        while client.sandboxes.get(done["sandbox_id"]).status != "hibernated":
            assert time.monotonic() < deadline, "the idle app never hibernated"
            time.sleep(1)
        started = time.monotonic()
        answer = app_get(server, f"nap-{RUN}")
        print(f"\na request to the hibernated app answered in {time.monotonic() - started:.2f} s (its wake included)")
        assert answer.status_code == 200 and answer.json()["version"] == 2
    finally:
        client.apps.delete(app["id"])


def test_the_cli_creates_deploys_and_removes_an_app(server: CladeServer, repo: Path) -> None:
    env = {**os.environ, "CLADE_API_URL": server.url, "CLADE_API_KEY": server.admin_key, "CLADE_CONFIG": "/nonexistent"}

    def clade(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN), *args], env=env, capture_output=True, text=True, timeout=600)

    name = f"cli-{RUN}"
    created = clade("app", "create", name, f"file://{repo}", "--port", "8081", "--env", "GREETING=from the cli")
    assert created.returncode == 0 and name in created.stdout and "created" in created.stdout, created.stderr
    assert clade("app", "env", "set", name, "API_SECRET", "cli-secret", "--secret").stdout.strip() == "set API_SECRET (secret)"
    deployed = clade("app", "deploy", name)
    assert deployed.returncode == 0, deployed.stderr + deployed.stdout
    assert "framework: python (detected)" in deployed.stdout
    assert f"live: http://{name}.localhost:{server.port}" in deployed.stdout
    body = app_get(server, name).json()
    assert (body["greeting"], body["secret"]) == ("from the cli", "cli-secret")
    assert "serving version 2 on 8081" in clade("app", "logs", name, "--runtime").stdout
    listed = json.loads(clade("app", "ls", "--json").stdout)["items"]
    assert [a["status"] for a in listed if a["name"] == name] == ["live"]
    refused = clade("app", "rollback", name)
    assert refused.returncode != 0 and "cannot roll back" in refused.stderr, refused
    assert clade("app", "rm", name).returncode == 0
    assert clade("app", "get", name).returncode != 0


def test_deleting_the_app_stops_its_host_name_and_removes_its_sandboxes(
    client: pandastack.Client, server: CladeServer, app: Dict
) -> None:
    sandboxes = {d.get("sandbox_id") for d in client.apps.deployments(app["id"])} - {None}
    assert sandboxes, "the app's deployments keep sandboxes"
    client.apps.delete(app["id"])
    assert app_get(server, f"shop-{RUN}").status_code == 404
    with pytest.raises(pandastack.NotFoundError):
        client.apps.get(app["id"])
    deadline = time.monotonic() + 60
    while sandboxes & {s.id for s in client.sandboxes.list()}:
        assert time.monotonic() < deadline, f"sandboxes left: {sandboxes & {s.id for s in client.sandboxes.list()}}"
        time.sleep(1)
