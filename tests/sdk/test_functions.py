"""Functions and schedules (issue 34) through the unmodified SDK's
`client.functions` and `client.schedules`, against a real server: each
deploy installs the code's requirements once in a real VM and snapshots it;
each invoke restores that snapshot and runs the handler.

The requirements are a wheel inside the bundle (a local path in
requirements.txt), so pip really installs a package without any outside
address. The schedule tests need a minute to pass: their schedules are made
by the first tests and checked by the last, so that the minute passes while
the others run.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Dict, Iterator

import pandastack
import pytest
import requests

from conftest import ARTIFACTS, BIN, CladeServer

pytestmark = pytest.mark.timeout(900)

# What the module's tests share: the deployed function, and the schedules
# made early and checked late.
shared: Dict[str, object] = {}

HANDLER = """\
import os
import greeting

def handler(event):
    name = (event or {}).get("name", "world")
    print("greeting", name)
    return {"greeting": greeting.greet(name), "version": greeting.VERSION, "secret": os.environ.get("SECRET")}
"""


def wheel(version: str) -> bytes:
    """A pure-Python wheel of the package `greeting`, made here (pip installs it with no index)."""
    files = {
        "greeting/__init__.py": f'VERSION = "{version}"\n\ndef greet(name):\n    return "hello " + name\n'.encode(),
        f"greeting-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: greeting\nVersion: {version}\n".encode(),
        f"greeting-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: clade-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"greeting-{version}.dist-info/RECORD,,")
    files[f"greeting-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


def code_dir(root: Path, version: str, requirement: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "handler.py").write_text(HANDLER)
    (root / "wheels").mkdir(exist_ok=True)
    name = f"greeting-{version}-py3-none-any.whl"
    (root / "wheels" / name).write_bytes(wheel(version))
    (root / "requirements.txt").write_text((requirement or f"./wheels/{name}") + "\n")
    # Left out of the bundle by the SDK, as a build's leftovers.
    (root / "__pycache__").mkdir(exist_ok=True)
    (root / "__pycache__" / "junk.pyc").write_bytes(b"\0" * 10)
    return root


def wait_deployed(client: pandastack.Client, fn_id: str, version: int, timeout: float = 600) -> dict:
    """Polls until version `version`'s deploy ends; returns the function."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.functions.get(fn_id)
        if info["version"] == version and info["status"] in ("ready", "failed"):
            return info
        assert time.monotonic() < deadline, f"function {fn_id} v{version} still deploying: {info}"
        time.sleep(0.5)


def raw(server, method: str, path: str, key=None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key or server.admin_key}", **kwargs.pop("headers", {})}
    return requests.request(method, f"{server.url}{path}", headers=headers, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def greeter(client, tmp_path_factory) -> Iterator[dict]:
    """The Python function, deployed with its requirements through the SDK's `deploy`."""
    source = code_dir(tmp_path_factory.mktemp("greeter"), "1.0")
    started = time.monotonic()
    created = client.functions.deploy("greeter", "python", str(source), env={"SECRET": "s1"})
    assert created["status"] == "deploying" and created["is_ready"] is False
    info = wait_deployed(client, created["id"], 1)
    print(f"deploy (a sandbox, pip install of a wheel, a snapshot): {time.monotonic() - started:.1f} s")
    assert info["status"] == "ready", info
    yield info
    try:
        client.functions.delete(info["id"])
    except pandastack.PandastackError:
        pass


@pytest.fixture(scope="module")
def stopped_server(requirements) -> Iterator[CladeServer]:
    """A server of its own that is down while its schedule comes due (a
    2-second grace, so that a run found later than that is skipped)."""
    server = CladeServer("missed-runs", args=["--schedule-grace", "2"]).start()
    yield server
    server.teardown(keep_log=ARTIFACTS.exists())


def test_a_deployed_function_runs_its_handler_with_the_input_and_its_installed_requirements(client, server, greeter):
    assert greeter["runtime"] == "python" and greeter["entrypoint"] == "handler.py"
    assert greeter["template"] == "code-interpreter" and greeter["env"] == {"SECRET": "s1"}
    assert greeter["is_ready"] is True and greeter["version"] == 1
    snapshots = {s["name"]: s["id"] for s in client._request("GET", "/snapshots")["snapshots"] if s.get("name")}
    assert snapshots[f"{greeter['id']}-v1"] == greeter["snapshot_id"], snapshots
    started = time.monotonic()
    run = client.functions.invoke(greeter["id"], input={"name": "Ada"})
    print(f"invoke (restore, run, answer): {time.monotonic() - started:.2f} s, duration_ms {run['duration_ms']}")
    assert run["status"] == "success", run
    assert run["exit_code"] == 0 and run["cold_start"] is True and run["invoked_by"] == "invoke"
    assert run["output"] == {"greeting": "hello Ada", "version": "1.0", "secret": "s1"}
    assert run["stdout"] == "greeting Ada\n"
    assert run["function_id"] == greeter["id"] and run["duration_ms"] > 0
    # The run's sandbox is gone once it has answered.
    sandbox = run["sandbox_id"]
    deadline = time.monotonic() + 30
    while any(s.id == sandbox for s in client.sandboxes.list()):
        assert time.monotonic() < deadline, f"the run's sandbox {sandbox} outlived it"
        time.sleep(0.5)
    # The code as kept: the SDK's bundle, without the __pycache__ it skips.
    code = raw(server, "GET", f"/v1/functions/{greeter['id']}/code")
    assert code.status_code == 200 and code.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(code.content), mode="r:gz") as tar:
        names = sorted(tar.getnames())
    assert names == ["handler.py", "requirements.txt", "wheels/greeting-1.0-py3-none-any.whl"], names


def test_schedules_are_made_with_their_next_run_and_bad_ones_are_refused(client, greeter, stopped_server):
    schedule = client.schedules.create("every-minute", greeter["id"], "* * * * *")
    now = time.time()
    next_run = _epoch(schedule["next_run_at"])
    assert now < next_run <= now + 61 and next_run % 60 == 0, schedule
    assert schedule["paused"] is False and schedule["timezone"] == "UTC" and "last_run_at" not in schedule
    shared["schedule"] = schedule
    paris = client.schedules.create("weekday-mornings", greeter["id"], "30 9 * * 1-5")
    client.schedules.update(paris["id"], paused=True)
    assert "next_run_at" not in client.schedules.get(paris["id"])
    client.schedules.delete(paris["id"])
    for cron, message in [("* * * *", "5 fields"), ("61 * * * *", "0-59"), ("0 0 30 2 *", "never")]:
        with pytest.raises(pandastack.BadRequestError) as refused:
            client.schedules.create("bad", greeter["id"], cron)
        assert message in str(refused.value), str(refused.value)

    # Another server, stopped before its schedule's first run is due.
    key = stopped_server.admin_key
    status, fn = stopped_server.api("POST", "/v1/functions", key, {"name": "nightly", "runtime": "python"})
    assert status == 200 and fn["status"] == "empty", fn
    status, missed = stopped_server.api("POST", "/v1/schedules", key, {"name": "m", "function_id": fn["id"], "cron": "* * * * *"})
    assert status == 200, missed
    shared["missed"] = missed
    stopped_server.stop()


def test_a_plain_script_gets_its_input_on_stdin_and_an_exception_is_an_error_run(client, tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import json, sys\nevent = json.load(sys.stdin)\nprint('sum', event['a'] + event['b'])\n")
    failing = tmp_path / "fail.py"
    failing.write_text("def handler(event):\n    return 1 / 0\n")
    echo = client.functions.create("echo", "python", str(script))
    fail = client.functions.create("fail", "python", str(failing), entrypoint="handler.py")
    try:
        assert echo["entrypoint"] == "echo.py" and echo["code_size"] == script.stat().st_size
        wait_deployed(client, echo["id"], 1)
        wait_deployed(client, fail["id"], 1)
        run = client.functions.invoke(echo["id"], input={"a": 2, "b": 3})
        assert (run["status"], run["exit_code"], run["stdout"]) == ("success", 0, "sum 5\n"), run
        assert "output" not in run
        failed = client.functions.trigger(fail["id"], input={})
        assert (failed["status"], failed["exit_code"]) == ("error", 1), failed
        assert "ZeroDivisionError" in failed["stderr"]
        runs = client.functions.runs(echo["id"])
        assert [r["id"] for r in runs] == [run["id"]] and runs[0]["status"] == "success"
        metrics = client.functions.metrics(fail["id"], period_hours=1)
        assert (metrics["total"], metrics["errors"], metrics["error_rate"], metrics["cold_start_rate"]) == (1, 1, 1.0, 1.0), metrics
        assert metrics["p50_ms"] == failed["duration_ms"] == metrics["p99_ms"]
    finally:
        client.functions.delete(echo["id"])
        client.functions.delete(fail["id"])


def test_env_changes_reach_the_next_run_without_a_deploy(client, greeter):
    updated = client.functions.update(greeter["id"], env={"SECRET": "s2"})
    assert updated["version"] == 1 and updated["status"] == "ready" and updated["env"] == {"SECRET": "s2"}
    run = client.functions.invoke(greeter["id"], input={"name": "Bo"})
    assert run["output"]["secret"] == "s2", run


def test_a_failed_deploy_keeps_the_version_before_it_running_and_says_why(client, greeter, tmp_path):
    broken = code_dir(tmp_path / "broken", "2.0", requirement="./wheels/missing-9.9-py3-none-any.whl")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(broken.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                tar.add(str(path), arcname=path.relative_to(broken).as_posix())
    deploying = client.functions.deploy_bundle(greeter["id"], buffer.getvalue())
    assert deploying["version"] == 2 and deploying["status"] == "deploying"
    failed = wait_deployed(client, greeter["id"], 2)
    assert failed["status"] == "failed" and failed["is_ready"] is False, failed
    assert "installing the dependencies failed" in failed["error"]
    assert "missing-9.9-py3-none-any.whl" in failed["deploy_log"], failed["deploy_log"]
    run = client.functions.invoke(greeter["id"], input={"name": "Cy"})
    assert run["status"] == "success" and run["output"]["version"] == "1.0", run
    # A good deploy after it runs the new code.
    fixed = code_dir(tmp_path / "fixed", "2.1")
    client.functions.deploy("greeter", "python", str(fixed))
    assert wait_deployed(client, greeter["id"], 3)["status"] == "ready"
    assert client.functions.invoke(greeter["id"], input={"name": "Di"})["output"]["version"] == "2.1"
    snapshots = {s["name"] for s in client._request("GET", "/snapshots")["snapshots"] if s.get("name")}
    assert f"{greeter['id']}-v3" in snapshots and f"{greeter['id']}-v1" not in snapshots, snapshots


def test_a_public_nodejs_function_answers_http_at_its_host(client, server, tmp_path):
    source = tmp_path / "handler.js"
    source.write_text(
        "exports.handler = async (event) => {\n"
        "  if (event.path) return { statusCode: 201, headers: { 'x-fn': 'yes' }, body: JSON.stringify({ path: event.path, query: event.query, body: event.body }) };\n"
        "  return { sum: event.a + event.b };\n"
        "};\n"
    )
    created = client.functions.create("adder", "nodejs", str(source), public=True)
    private = client.functions.create("hidden", "nodejs", str(source))
    try:
        info = wait_deployed(client, created["id"], 1)
        assert info["status"] == "ready", info
        port = server.url.rsplit(":", 1)[1]
        assert info["url"] == f"http://{created['id']}.localhost:{port}" == info["endpoint"]
        assert client.functions.invoke(created["id"], input={"a": 1, "b": 2})["output"] == {"sum": 3}
        answer = requests.post(f"{server.url}/hello?x=1", data="ping", headers={"Host": f"{created['id']}.localhost:{port}"}, timeout=300)
        assert answer.status_code == 201 and answer.headers["x-fn"] == "yes", answer.text
        assert answer.json() == {"path": "/hello", "query": "x=1", "body": "ping"}
        assert client.functions.runs(created["id"])[0]["invoked_by"] == "http"
        hidden = requests.get(f"{server.url}/", headers={"Host": f"{private['id']}.localhost:{port}"}, timeout=60)
        assert hidden.status_code == 404 and "url" not in private
    finally:
        client.functions.delete(created["id"])
        client.functions.delete(private["id"])


def test_the_cli_creates_invokes_and_schedules_functions(server, tmp_path):
    env = {**os.environ, "CLADE_API_URL": server.url, "CLADE_API_KEY": server.admin_key, "CLADE_CONFIG": "/nonexistent"}

    def clade(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN), *args], env=env, capture_output=True, text=True, timeout=600)

    source = tmp_path / "handler.py"
    source.write_text("import sys\ndef handler(event):\n    print('to stdout')\n    if event.get('fail'):\n        sys.exit(7)\n    return {'hello': event['name']}\n")
    created = clade("fn", "create", "cli-hello", str(source), "--template", "base", "--env", "A=1")
    assert created.returncode == 0, created.stderr
    assert "cli-hello" in created.stdout and "ready" in created.stdout
    invoked = clade("fn", "invoke", "cli-hello", "--input", '{"name": "Ada"}')
    assert invoked.returncode == 0 and json.loads(invoked.stdout) == {"hello": "Ada"}, invoked
    assert "to stdout" in invoked.stderr
    failed = clade("fn", "invoke", "cli-hello", "--input", '{"fail": true}')
    assert failed.returncode == 7, failed
    runs = clade("fn", "runs", "cli-hello", "--json")
    assert [r["exit_code"] for r in json.loads(runs.stdout)["items"]] == [7, 0], runs.stdout
    bad = clade("fn", "invoke", "cli-hello", "--input", "{not json")
    assert bad.returncode != 0 and "not JSON" in bad.stderr
    scheduled = clade("schedule", "create", "cli-nightly", "--fn", "cli-hello", "--cron", "0 3 * * *", "--input", '{"name": "cron"}', "--json")
    assert scheduled.returncode == 0, scheduled.stderr
    assert json.loads(scheduled.stdout)["next_run_at"].endswith("T03:00:00.000Z")
    triggered = clade("schedule", "trigger", "cli-nightly")
    assert triggered.returncode == 0 and json.loads(triggered.stdout) == {"hello": "cron"}, triggered
    paused = clade("schedule", "pause", "cli-nightly", "--json")
    assert json.loads(paused.stdout)["paused"] is True
    assert clade("schedule", "rm", "cli-nightly").returncode == 0
    assert clade("fn", "rm", "cli-hello").returncode == 0
    missing = clade("fn", "get", "cli-hello")
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_bad_requests_get_clear_errors_and_other_workspaces_see_nothing(client, other_client, server, greeter):
    def status_and_error(method: str, path: str, **kwargs):
        answer = raw(server, method, path, **kwargs)
        return answer.status_code, answer.json().get("error", "") if answer.content else ""

    assert status_and_error("POST", "/v1/functions", json={"name": "x", "runtime": "ruby"}) == (400, "runtime must be python or nodejs")
    status, error = status_and_error("POST", "/v1/functions", json={"name": "greeter", "runtime": "python"})
    assert status == 409 and "greeter" in error
    big = base64.b64encode(b"#" * (600 << 10)).decode()
    status, error = status_and_error("POST", "/v1/functions", json={"name": "big", "runtime": "python", "code": big})
    assert status == 413 and "512 KiB" in error
    status, error = status_and_error("POST", f"/v1/functions/{greeter['id']}/deploy", files={"bundle": ("code.tar.gz", b"not a tarball")})
    assert status == 400 and "tar.gz" in error, error
    status, error = status_and_error("POST", f"/v1/functions/{greeter['id']}/invoke", data="{bad json")
    assert status == 400 and "invalid JSON body" in error
    empty = client._request("POST", "/functions", json={"name": "empty", "runtime": "python"})
    try:
        with pytest.raises(pandastack.ServerError, match="function not ready — deploy code first"):
            client.functions.invoke(empty["id"])
    finally:
        client.functions.delete(empty["id"])
    with pytest.raises(pandastack.BadRequestError, match="Mars/Olympus"):
        client._request("POST", "/schedules", json={"name": "tz", "function_id": greeter["id"], "cron": "@daily", "timezone": "Mars/Olympus"})
    for call in (
        lambda: other_client.functions.get(greeter["id"]),
        lambda: other_client.functions.invoke(greeter["id"]),
        lambda: other_client.functions.runs(greeter["id"]),
        lambda: other_client.functions.delete(greeter["id"]),
        lambda: other_client.schedules.get(shared["schedule"]["id"]),
        lambda: other_client.schedules.trigger(shared["schedule"]["id"]),
        lambda: other_client.schedules.create("steal", greeter["id"], "* * * * *"),
        lambda: client.functions.get("fn-0000000000000000"),
    ):
        with pytest.raises(pandastack.NotFoundError) as missing:
            call()
        assert greeter["name"] not in str(missing.value), str(missing.value)
    assert greeter["id"] not in json.dumps(other_client.functions.list())
    assert client.functions.get(greeter["id"])["status"] == "ready"


def test_a_schedule_fires_once_in_its_minute_and_records_the_run(client, greeter):
    schedule = shared["schedule"]
    due = _epoch(schedule["next_run_at"])
    deadline = due + 120
    while True:
        runs = client.schedules.runs(schedule["id"])
        if any(r["status"] != "running" for r in runs):
            break
        assert time.time() < deadline, f"no run of {schedule['id']} by {deadline - due:.0f} s after it was due: {runs}"
        time.sleep(1)
    in_due_minute = [r for r in runs if due <= _epoch(r["started_at"]) < due + 60]
    assert len(in_due_minute) == 1, runs
    run = in_due_minute[0]
    assert (run["status"], run["invoked_by"], run["schedule_id"]) == ("success", "schedule", schedule["id"]), run
    info = client.schedules.get(schedule["id"])
    assert _epoch(info["last_run_at"]) == due and _epoch(info["next_run_at"]) >= due + 60, info
    triggered = client.schedules.trigger(schedule["id"])
    assert triggered["status"] == "success" and triggered["schedule_id"] == schedule["id"]
    paused = client.schedules.update(schedule["id"], paused=True)
    assert paused["paused"] is True and "next_run_at" not in paused
    client.schedules.delete(schedule["id"])


def test_a_run_due_while_the_servers_were_down_is_skipped_with_a_record(stopped_server):
    missed = shared["missed"]
    due = _epoch(missed["next_run_at"])
    time.sleep(max(0.0, due + 3 - time.time()))
    stopped_server.start()
    key = stopped_server.admin_key
    deadline = time.monotonic() + 30
    while True:
        status, runs = stopped_server.api("GET", f"/v1/schedules/{missed['id']}/runs", key)
        assert status == 200, runs
        if runs["items"]:
            break
        assert time.monotonic() < deadline, "the missed run was not recorded"
        time.sleep(0.5)
    (run,) = runs["items"]
    assert run["status"] == "skipped" and _epoch(run["started_at"]) == due, run
    assert "no server could start it within 2 s" in run["stderr"]
    status, info = stopped_server.api("GET", f"/v1/schedules/{missed['id']}", key)
    assert "last_run_at" not in info and _epoch(info["next_run_at"]) > time.time() - 1, info


def _epoch(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
