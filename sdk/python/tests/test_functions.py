"""Functions and schedules through `client.functions` and
`client.schedules`: one Python function, created with its code and
invoked; a directory deployed over it and run; a broken deploy that
raises with its log and leaves the version before it running; a schedule
triggered, paused and deleted; and the 503 and 404s. Each deploy boots a
sandbox and snapshots it (seconds under TCG), so the tests share one
function, in this order, and use the `base` template (Python without the
code-interpreter's weight)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Dict, Iterator

import pytest

import clade

CREATED_HANDLER = """\
import os

def handler(event):
    print("hello", event["name"])
    return {"version": "created", "greeting": os.environ["GREETING"] + " " + event["name"], "event": event}
"""

DEPLOYED_HANDLER = """\
from lib.words import shout

def handler(event):
    print("deployed", event["name"])
    return {"version": "deployed", "greeting": shout(event["name"]), "event": event}
"""


def tar_gz(files: Dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def names_in(bundle: bytes) -> Dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def function(client: clade.Clade) -> Iterator[clade.FunctionInfo]:
    fn = client.functions.create("sdk-greeter", "python", code=CREATED_HANDLER, template="base", env={"GREETING": "hi"})
    yield fn
    client.functions.delete(fn.id)


def test_a_function_created_with_code_runs_its_handler_with_the_input(client: clade.Clade, function: clade.FunctionInfo) -> None:
    assert function.status == "ready" and function.is_ready and function.version == 1 and function.snapshot_id
    assert function.runtime == "python" and function.entrypoint == "handler.py" and function.template == "base"
    assert function.id in [f.id for f in client.functions.list()] and client.functions.get("sdk-greeter").id == function.id
    assert names_in(client.functions.code(function.id)) == {"handler.py": CREATED_HANDLER.encode()}

    run = client.functions.invoke(function.id, {"name": "ada"})
    assert (run.status, run.exit_code, run.invoked_by, run.function_id) == ("success", 0, "invoke", function.id), run.stderr
    assert run.output == {"version": "created", "greeting": "hi ada", "event": {"name": "ada"}}
    assert run.stdout == "hello ada\n" and run.cold_start and run.duration_ms is not None

    recorded = client.functions.record_run(function.id, "error", exit_code=1, stderr="boom", duration_ms=5)
    assert recorded.invoked_by == "recorded" and recorded.status == "error"
    assert [r.id for r in client.functions.runs(function.id, limit=10)] == [recorded.id, run.id]
    metrics = client.functions.metrics(function.id, period_hours=1)
    assert (metrics.period, metrics.total, metrics.errors, metrics.error_rate, metrics.cold_start_rate) == (1, 2, 1, 0.5, 0.5)

    # Env applies to the next run without a deploy.
    updated = client.functions.update(function.id, env={"GREETING": "hello"}, timeout_seconds=60)
    assert updated.env == {"GREETING": "hello"} and updated.timeout_seconds == 60 and updated.version == 1 and updated.status == "ready"


def test_a_directory_deployed_runs_its_new_code_and_a_broken_deploy_leaves_it_running(
    client: clade.Clade, function: clade.FunctionInfo, tmp_path: Path
) -> None:
    app = tmp_path / "app"
    (app / "lib").mkdir(parents=True)
    (app / "handler.py").write_text(DEPLOYED_HANDLER)
    (app / "lib" / "__init__.py").write_text("")
    (app / "lib" / "words.py").write_text("def shout(name):\n    return name.upper() + '!'\n")
    (app / "requirements.txt").write_text("# nothing to install (the deploy runs pip on it, offline)\n")
    for skipped in ("node_modules/left-pad/index.js", "__pycache__/handler.cpython-311.pyc", ".git/HEAD"):
        (app / skipped).parent.mkdir(parents=True, exist_ok=True)
        (app / skipped).write_text("not code")
    before = client.functions.get(function.id)

    deployed = client.functions.deploy(function.id, app)
    assert deployed.status == "ready" and deployed.version == before.version + 1, deployed.deploy_log
    assert "pip install -r requirements.txt" in (deployed.deploy_log or "")
    assert sorted(names_in(client.functions.code(function.id))) == ["handler.py", "lib/__init__.py", "lib/words.py", "requirements.txt"]
    run = client.functions.invoke(function.id, {"name": "ada"})
    assert run.status == "success" and run.output == {"version": "deployed", "greeting": "ADA!", "event": {"name": "ada"}}, run.stderr
    assert run.stdout == "deployed ada\n"

    broken = tar_gz({"handler.py": "def handler(event):\n    return 'broken'\n", "requirements.txt": "./missing-1.0-py3-none-any.whl\n"})
    with pytest.raises(clade.FunctionDeployError) as failed:
        client.functions.deploy(function.id, broken)
    assert failed.value.function.status == "failed" and failed.value.function.version == deployed.version + 1
    assert failed.value.error and "missing-1.0-py3-none-any.whl" in (failed.value.deploy_log or ""), failed.value
    still = client.functions.invoke(function.id, {"name": "bob"})
    assert still.status == "success" and still.output["version"] == "deployed", still.stderr


def test_a_schedule_triggers_its_function_and_pauses(client: clade.Clade, function: clade.FunctionInfo) -> None:
    schedule = client.schedules.create("sdk-nightly", function.id, "0 3 * * *", input={"name": "cron"})
    try:
        assert (schedule.function_id, schedule.cron, schedule.timezone, schedule.paused) == (function.id, "0 3 * * *", "UTC", False)
        assert schedule.next_run_at and schedule.next_run_at[11:16] == "03:00" and schedule.input == {"name": "cron"}
        assert schedule.id in [s.id for s in client.schedules.list()] and client.schedules.get("sdk-nightly").id == schedule.id

        run = client.schedules.trigger(schedule.id)
        assert (run.status, run.schedule_id, run.invoked_by) == ("success", schedule.id, "schedule"), run.stderr
        assert run.output["event"] == {"name": "cron"}
        assert [r.id for r in client.schedules.runs(schedule.id)] == [run.id]

        paused = client.schedules.pause(schedule.id)
        assert paused.paused and paused.next_run_at is None
        resumed = client.schedules.update(schedule.id, paused=False, cron="@hourly", timezone="Europe/Paris")
        assert not resumed.paused and resumed.next_run_at and resumed.cron == "@hourly" and resumed.timezone == "Europe/Paris"
    finally:
        client.schedules.delete(schedule.id)
    with pytest.raises(clade.NotFoundError):
        client.schedules.get(schedule.id)
    assert run.id in [r.id for r in client.functions.runs(function.id)], "a schedule's runs stay with its function"


def test_a_function_without_code_is_not_ready_until_deployed(client: clade.Clade) -> None:
    empty = client.functions.create("sdk-empty", "python")
    try:
        assert empty.status == "empty" and not empty.is_ready and empty.version == 0
        with pytest.raises(clade.ServiceUnavailableError, match="deploy code first"):
            client.functions.invoke(empty.id)
    finally:
        client.functions.delete(empty.id)


async def test_an_unknown_function_and_another_workspaces_are_not_found(
    aclient: clade.AsyncClade, other_client: clade.Clade, function: clade.FunctionInfo
) -> None:
    with pytest.raises(clade.NotFoundError):
        await aclient.functions.get("fn-0000000000000000")
    with pytest.raises(clade.NotFoundError):
        await aclient.functions.invoke("no-such-function", {})
    with pytest.raises(clade.NotFoundError):
        other_client.functions.get(function.id)
    with pytest.raises(clade.NotFoundError):
        other_client.functions.invoke(function.id)
    with pytest.raises(clade.NotFoundError):
        other_client.schedules.create("theirs", function.id, "@daily")
