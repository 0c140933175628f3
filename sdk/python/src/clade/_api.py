"""Every operation of docs/openapi.json as a `Call`: its method, path,
query, body, headers and how its answer is read. Written once and sent by
either client (`_sync`, `_async`), which only do the I/O.

`OPERATIONS` maps each operationId to the SDK method that calls it and
`NOT_COVERED` lists the ones the SDK leaves out, with why; a test checks
that together they name every operation of docs/openapi.json."""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, List, Mapping, Optional, Sequence, TypeVar, Union
from urllib.parse import quote

import httpx

from . import _generated as gen
from ._models import DatabaseStats, Execution

T = TypeVar("T")

#: operationId → the SDK method that calls it (on both clients; `Sandbox.`
#: names a method of `Sandbox` / `AsyncSandbox`, others hang off the client).
OPERATIONS: Dict[str, str] = {
    "healthz": "health",
    "version": "version",
    "me": "me",
    "listTokens": "keys.list",
    "createToken": "keys.create",
    "revokeToken": "keys.revoke",
    "listTemplates": "templates.list",
    "getTemplate": "templates.get",
    "deleteTemplate": "templates.delete",
    "buildTemplate": "templates.build",
    "listTemplateBuilds": "builds.list",
    "getTemplateBuild": "builds.get",
    "templateBuildLogs": "builds.logs",
    "cancelTemplateBuild": "builds.cancel",
    "listSandboxes": "sandboxes.list",
    "createSandbox": "sandboxes.create",
    "getSandbox": "sandboxes.get",
    "deleteSandbox": "Sandbox.delete",
    "updateSandbox": "Sandbox.update",
    "listEvents": "Sandbox.events",
    "exec": "Sandbox.exec",
    "execStream": "Sandbox.exec_stream",
    "listCodeContexts": "Sandbox.list_code_contexts",
    "createCodeContext": "Sandbox.create_code_context",
    "deleteCodeContext": "CodeContext.delete",
    "runCode": "Sandbox.run_code",
    "logs": "Sandbox.logs",
    "readFile": "Files.read",
    "writeFile": "Files.write",
    "removePath": "Files.remove",
    "listDir": "Files.list",
    "statPath": "Files.stat",
    "pause": "Sandbox.pause",
    "resume": "Sandbox.resume",
    "hibernate": "Sandbox.hibernate",
    "stop": "Sandbox.stop",
    "wake": "Sandbox.wake",
    "start": "Sandbox.start",
    "getLifecycle": "Sandbox.get_lifecycle",
    "patchLifecycle": "Sandbox.set_lifecycle",
    "getNetwork": "Network.get",
    "setNetwork": "Network.set",
    "getLimits": "Limits.get",
    "setLimits": "Limits.set",
    "createSnapshot": "Sandbox.snapshot",
    "listSnapshots": "snapshots.list",
    "getSnapshot": "snapshots.get",
    "deleteSnapshot": "snapshots.delete",
    "listVolumes": "volumes.list",
    "createVolume": "volumes.create",
    "getVolume": "volumes.get",
    "deleteVolume": "volumes.delete",
    "resizeVolume": "volumes.resize",
    "fork": "Sandbox.fork",
    "forkTree": "Sandbox.fork_tree",
    "promote": "Sandbox.promote",
    "listPorts": "Ports.list",
    "addPort": "Ports.add",
    "removePort": "Ports.remove",
    "createPreviewToken": "Sandbox.preview_token",
    "listDatabases": "databases.list",
    "createDatabase": "databases.create",
    "getDatabase": "databases.get",
    "updateDatabase": "databases.update",
    "deleteDatabase": "databases.delete",
    "databaseConnection": "databases.connection",
    "resetDatabaseCredentials": "databases.reset_credentials",
    "wakeDatabase": "databases.wake",
    "cloneDatabase": "databases.clone",
    "failoverDatabase": "databases.failover",
    "databaseStats": "databases.stats",
    "databaseLogs": "databases.logs",
    "databaseQuery": "databases.query",
    "listFunctions": "functions.list",
    "createFunction": "functions.create",
    "getFunction": "functions.get",
    "updateFunction": "functions.update",
    "deleteFunction": "functions.delete",
    "deployFunction": "functions.deploy",
    "invokeFunction": "functions.invoke",
    "listFunctionRuns": "functions.runs",
    "recordFunctionRun": "functions.record_run",
    "functionMetrics": "functions.metrics",
    "functionCode": "functions.code",
    "listSchedules": "schedules.list",
    "createSchedule": "schedules.create",
    "getSchedule": "schedules.get",
    "updateSchedule": "schedules.update",
    "deleteSchedule": "schedules.delete",
    "triggerSchedule": "schedules.trigger",
    "listScheduleRuns": "schedules.runs",
    "createApp": "apps.create",
    "listApps": "apps.list",
    "getApp": "apps.get",
    "updateApp": "apps.update",
    "deleteApp": "apps.delete",
    "deployApp": "apps.deploy",
    "listDeployments": "apps.deployments",
    "getDeployment": "apps.deployment",
    "deploymentLogs": "apps.deploy_logs",
    "rollbackApp": "apps.rollback",
    "listAppEnv": "apps.env",
    "setAppEnv": "apps.set_env",
    "unsetAppEnv": "apps.unset_env",
    "importAppEnv": "apps.import_env",
    "appRuntimeLogs": "apps.runtime_logs",
}

#: Operations the SDK does not call, and why.
NOT_COVERED: Dict[str, str] = {
    "metrics": "Prometheus text for the operator's scraper, not for programs",
    "openapi": "the API's own description, read by tools",
    "ssh": "a WebSocket terminal (the `clade sandbox shell` CLI)",
    "execPty": "a WebSocket terminal (the `clade sandbox shell` CLI)",
    "connectPort": "a raw TCP tunnel over a WebSocket upgrade (`clade sandbox port-forward`)",
    "proxyRoot": "an HTTP proxy into the sandbox: use `Sandbox.preview_url`",
    "proxy": "an HTTP proxy into the sandbox: use `Sandbox.preview_url`",
}

Parse = Callable[[httpx.Response], T]


@dataclass
class Call(Generic[T]):
    """One request, as both clients send it."""

    operation: str
    method: str
    path: str
    parse: Parse[T]
    params: Optional[Dict[str, Any]] = None
    json: Any = None
    headers: Dict[str, str] = field(default_factory=dict)
    #: A raw body (bytes); streamed bodies are the clients' own.
    content: Optional[bytes] = None
    #: Multipart form fields and files (`buildTemplate`, `deployFunction`).
    data: Optional[Dict[str, str]] = None
    files: Optional[List[Any]] = None
    #: Seconds for this call, over the client's timeout.
    timeout: Optional[float] = None


def _json(model: Callable[[Any], T]) -> Parse[T]:
    return lambda response: model(response.json())


def _json_list(model: Callable[[Any], T]) -> Parse[List[T]]:
    return lambda response: [model(item) for item in response.json()]


def _nothing(response: httpx.Response) -> None:
    return None


def _text(response: httpx.Response) -> str:
    return response.text


def _raw(response: httpx.Response) -> httpx.Response:
    return response


def _bytes(response: httpx.Response) -> bytes:
    return response.content


def _segment(value: Union[str, int]) -> str:
    return quote(str(value), safe="")


def sandbox_path(sandbox_id: str, rest: str = "") -> str:
    return f"/v1/sandboxes/{_segment(sandbox_id)}{rest}"


def idempotency_headers(key: Optional[str]) -> Dict[str, str]:
    """Every create, fork, fork-tree and snapshot carries a key: the same one
    on each retry, so the server makes the thing once."""
    return {"Idempotency-Key": key or str(uuid.uuid4())}


def without_none(**fields: Any) -> Dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


# Server ------------------------------------------------------------------

def health() -> Call[gen.Health]:
    return Call("healthz", "GET", "/healthz", _json(gen.Health.from_json))


def version() -> Call[gen.Version]:
    return Call("version", "GET", "/version", _json(gen.Version.from_json))


def me() -> Call[gen.Me]:
    return Call("me", "GET", "/v1/me", _json(gen.Me.from_json))


# API keys ----------------------------------------------------------------

def list_tokens() -> Call[List[gen.Token]]:
    return Call("listTokens", "GET", "/v1/me/tokens", lambda r: gen.Tokens.from_json(r.json()).items)


def create_token(label: Optional[str], expires_in_days: Optional[int], format: Optional[str] = None) -> Call[gen.Token]:
    body = gen.CreateToken(label=label, expires_in_days=expires_in_days, format=format).to_json()
    return Call("createToken", "POST", "/v1/me/tokens", _json(gen.Token.from_json), json=body)


def revoke_token(prefix: str) -> Call[None]:
    return Call("revokeToken", "DELETE", f"/v1/me/tokens/{_segment(prefix)}", _nothing)


# Templates and builds ----------------------------------------------------

def list_templates() -> Call[List[gen.Template]]:
    return Call("listTemplates", "GET", "/v1/templates", _json_list(gen.Template.from_json))


def get_template(name: str) -> Call[gen.Template]:
    return Call("getTemplate", "GET", f"/v1/templates/{_segment(name)}", _json(gen.Template.from_json))


def delete_template(name: str) -> Call[None]:
    return Call("deleteTemplate", "DELETE", f"/v1/templates/{_segment(name)}", _nothing)


def build_template(
    name: str,
    *,
    dockerfile: Optional[str],
    context: Optional[Mapping[str, bytes]],
    image_ref: Optional[str],
    rootfs: Any,
    size_mb: Optional[int],
    cpu: Optional[int],
    memory_mb: Optional[int],
    replace: Optional[bool],
) -> Call[gen.TemplateBuild]:
    """A build as multipart: fields, the context's files (each a part named by
    its relative path) and a `rootfs` archive (an open binary file)."""
    data = {key: str(value) for key, value in without_none(
        name=name, dockerfile=dockerfile, image_ref=image_ref, size_mb=size_mb, cpu=cpu, memory_mb=memory_mb
    ).items()}
    if replace is not None:
        data["replace"] = "true" if replace else "false"
    files: List[Any] = [(path, (path, content, "application/octet-stream")) for path, content in (context or {}).items()]
    if rootfs is not None:
        files.append(("rootfs", ("rootfs.tar", rootfs, "application/octet-stream")))
    # Without files httpx sends the fields urlencoded, which the server takes too.
    return Call("buildTemplate", "POST", "/v1/templates/build", _json(gen.TemplateBuild.from_json), data=data, files=files or None)


def list_builds() -> Call[List[gen.TemplateBuild]]:
    return Call("listTemplateBuilds", "GET", "/v1/templates/builds", _json_list(gen.TemplateBuild.from_json))


def get_build(build_id: str) -> Call[gen.TemplateBuild]:
    return Call("getTemplateBuild", "GET", f"/v1/templates/builds/{_segment(build_id)}", _json(gen.TemplateBuild.from_json))


def cancel_build(build_id: str) -> Call[gen.TemplateBuild]:
    return Call("cancelTemplateBuild", "DELETE", f"/v1/templates/builds/{_segment(build_id)}", _json(gen.TemplateBuild.from_json))


def build_logs(build_id: str, follow: bool) -> Call[httpx.Response]:
    params = {"follow": "1"} if follow else None
    return Call("templateBuildLogs", "GET", f"/v1/templates/builds/{_segment(build_id)}/logs", _raw, params=params)


# Sandboxes ---------------------------------------------------------------

def list_sandboxes() -> Call[List[gen.Sandbox]]:
    return Call("listSandboxes", "GET", "/v1/sandboxes", _json_list(gen.Sandbox.from_json))


#: Seconds a create may take: the first sandbox of a template's shape on a
#: host bakes the template's snapshot first (a minute or more when the host
#: emulates the VM), so the client's shorter timeout would give up on it.
CREATE_TIMEOUT = 600.0


def create_sandbox(body: gen.CreateSandboxBody, idempotency_key: Optional[str]) -> Call[gen.Sandbox]:
    return Call("createSandbox", "POST", "/v1/sandboxes", _json(gen.Sandbox.from_json), json=body.to_json(),
                headers=idempotency_headers(idempotency_key), timeout=CREATE_TIMEOUT)


def get_sandbox(sandbox_id: str) -> Call[gen.Sandbox]:
    return Call("getSandbox", "GET", sandbox_path(sandbox_id), _json(gen.Sandbox.from_json))


def delete_sandbox(sandbox_id: str) -> Call[None]:
    return Call("deleteSandbox", "DELETE", sandbox_path(sandbox_id), _nothing)


def update_sandbox(sandbox_id: str, preview_auth: Optional[bool]) -> Call[gen.Sandbox]:
    body = gen.SandboxPatch(preview_auth=preview_auth).to_json()
    return Call("updateSandbox", "PATCH", sandbox_path(sandbox_id), _json(gen.Sandbox.from_json), json=body)


def list_events(sandbox_id: str, tail: Optional[int]) -> Call[List[gen.Event]]:
    params = without_none(tail=tail)
    return Call("listEvents", "GET", sandbox_path(sandbox_id, "/events"), lambda r: gen.Events.from_json(r.json()).events, params=params)


def follow_events(sandbox_id: str, tail: Optional[int]) -> Call[httpx.Response]:
    params = {"follow": "1", **without_none(tail=tail)}
    return Call("listEvents", "GET", sandbox_path(sandbox_id, "/events"), _raw, params=params)


def logs(sandbox_id: str, stream: str) -> Call[str]:
    return Call("logs", "GET", sandbox_path(sandbox_id, "/logs"), _text, params={"stream": stream})


def follow_logs(sandbox_id: str, stream: str) -> Call[httpx.Response]:
    return Call("logs", "GET", sandbox_path(sandbox_id, "/logs"), _raw, params={"stream": stream, "follow": "1"})


# Exec --------------------------------------------------------------------

#: How long past a command's own timeout the HTTP request waits for its answer.
EXEC_MARGIN_SECONDS = 30.0
#: The server's default command timeout (ExecBody.timeout_seconds).
SERVER_EXEC_TIMEOUT = 300


def exec_body(cmd: str, timeout: Optional[int], env: Optional[Mapping[str, str]], cwd: Optional[str]) -> Dict[str, Any]:
    """`sh -c cmd`; `env` is set verbatim (not shell-expanded), `cwd` is absolute."""
    return gen.ExecBody(cmd=cmd, timeout_seconds=timeout, env=dict(env) if env is not None else None, cwd=cwd).to_json()


def exec_timeouts(timeout: Optional[float], request_timeout: Optional[float]) -> "tuple[Optional[int], float]":
    """The command's timeout (whole seconds, for the server) and the HTTP
    request's (the command's and a margin, unless given)."""
    seconds = None if timeout is None else max(1, int(-(-timeout // 1)))
    http = request_timeout if request_timeout is not None else (seconds or SERVER_EXEC_TIMEOUT) + EXEC_MARGIN_SECONDS
    return seconds, http


def exec_command(sandbox_id: str, body: Dict[str, Any], request_timeout: float) -> Call[gen.ExecResult]:
    return Call("exec", "POST", sandbox_path(sandbox_id, "/exec"), _json(gen.ExecResult.from_json), json=body, timeout=request_timeout)


def exec_stream(sandbox_id: str, body: Dict[str, Any], request_timeout: Optional[float]) -> Call[httpx.Response]:
    return Call("execStream", "POST", sandbox_path(sandbox_id, "/exec/stream"), _raw, json=body,
                headers={"Accept": "text/event-stream"}, timeout=request_timeout)


# Code contexts -----------------------------------------------------------

def list_code_contexts(sandbox_id: str) -> Call[List[gen.CodeContext]]:
    return Call("listCodeContexts", "GET", sandbox_path(sandbox_id, "/repl/sessions"), _json_list(gen.CodeContext.from_json))


def create_code_context(sandbox_id: str, language: Optional[str], cwd: Optional[str]) -> Call[gen.CodeContext]:
    body = gen.CreateContextBody(language=language, cwd=cwd).to_json()
    return Call("createCodeContext", "POST", sandbox_path(sandbox_id, "/repl/sessions"), _json(gen.CodeContext.from_json), json=body)


def delete_code_context(sandbox_id: str, context_id: str) -> Call[None]:
    return Call("deleteCodeContext", "DELETE", sandbox_path(sandbox_id, f"/repl/sessions/{_segment(context_id)}"), _nothing)


def code_timeouts(timeout: Optional[float], request_timeout: Optional[float]) -> "tuple[Optional[int], float]":
    """The cell's timeout (ms, for the server) and the HTTP request's."""
    millis = None if timeout is None else max(1, int(timeout * 1000))
    http = request_timeout if request_timeout is not None else (millis or 30_000) / 1000 + EXEC_MARGIN_SECONDS
    return millis, http


def run_code(sandbox_id: str, context_id: str, code: str, timeout_ms: Optional[int], request_timeout: float) -> Call[Execution]:
    body = gen.RunCodeBody(code=code, timeout_ms=timeout_ms).to_json()
    return Call("runCode", "POST", sandbox_path(sandbox_id, f"/repl/sessions/{_segment(context_id)}/run"),
                _json(Execution.from_json), json=body, timeout=request_timeout)


def run_code_stream(sandbox_id: str, context_id: str, code: str, timeout_ms: Optional[int], request_timeout: float) -> Call[httpx.Response]:
    body = gen.RunCodeBody(code=code, timeout_ms=timeout_ms).to_json()
    return Call("runCode", "POST", sandbox_path(sandbox_id, f"/repl/sessions/{_segment(context_id)}/run"),
                _raw, json=body, headers={"Accept": "text/event-stream"}, timeout=request_timeout)


# Files -------------------------------------------------------------------

def read_file(sandbox_id: str, path: str, request_timeout: Optional[float]) -> Call[httpx.Response]:
    return Call("readFile", "GET", sandbox_path(sandbox_id, "/fs"), _raw, params={"path": path}, timeout=request_timeout)


def write_file(sandbox_id: str, path: str, content: Optional[bytes], request_timeout: Optional[float]) -> Call[gen.Written]:
    """With `content` None the client streams the body itself."""
    return Call("writeFile", "PUT", sandbox_path(sandbox_id, "/fs"), _json(gen.Written.from_json), params={"path": path},
                content=content, headers={"Content-Type": "application/octet-stream"}, timeout=request_timeout)


def remove_path(sandbox_id: str, path: str) -> Call[None]:
    return Call("removePath", "DELETE", sandbox_path(sandbox_id, "/fs"), _nothing, params={"path": path})


def list_dir(sandbox_id: str, path: str) -> Call[List[gen.FileEntry]]:
    return Call("listDir", "GET", sandbox_path(sandbox_id, "/fs/dir"), lambda r: gen.DirListing.from_json(r.json()).entries, params={"path": path})


def stat_path(sandbox_id: str, path: str) -> Call[gen.FileEntry]:
    return Call("statPath", "GET", sandbox_path(sandbox_id, "/fs/stat"), _json(gen.FileEntry.from_json), params={"path": path})


# Lifecycle ---------------------------------------------------------------

def pause(sandbox_id: str) -> Call[None]:
    return Call("pause", "POST", sandbox_path(sandbox_id, "/pause"), _nothing)


def resume(sandbox_id: str) -> Call[None]:
    return Call("resume", "POST", sandbox_path(sandbox_id, "/resume"), _nothing)


def _status(operation: str, sandbox_id: str, verb: str, body: Optional[Any] = None) -> Call[str]:
    return Call(operation, "POST", sandbox_path(sandbox_id, f"/{verb}"), lambda r: gen.LifecycleStatus.from_json(r.json()).status,
                json=body)


def hibernate(sandbox_id: str, memory: bool = True) -> Call[str]:
    return _status("hibernate", sandbox_id, "hibernate", None if memory else gen.HibernateBody(memory=False).to_json())


def wake(sandbox_id: str) -> Call[str]:
    return _status("wake", sandbox_id, "wake")


def stop(sandbox_id: str) -> Call[str]:
    return _status("stop", sandbox_id, "stop")


def start(sandbox_id: str) -> Call[str]:
    return _status("start", sandbox_id, "start")


def get_lifecycle(sandbox_id: str) -> Call[gen.LifecycleSettings]:
    return Call("getLifecycle", "GET", sandbox_path(sandbox_id, "/lifecycle"), _json(gen.LifecycleSettings.from_json))


def patch_lifecycle(
    sandbox_id: str, ttl_seconds: Optional[int], persistent: Optional[bool], hibernate_after_seconds: Optional[int] = None,
    hibernate_memory: Optional[bool] = None,
) -> Call[gen.LifecycleSettings]:
    body = gen.LifecyclePatch(ttl_seconds=ttl_seconds, persistent=persistent, hibernate_after_seconds=hibernate_after_seconds,
                              hibernate_memory=hibernate_memory).to_json()
    return Call("patchLifecycle", "PATCH", sandbox_path(sandbox_id, "/lifecycle"), _json(gen.LifecycleSettings.from_json), json=body)


# Network and limits ------------------------------------------------------

def get_network(sandbox_id: str) -> Call[gen.NetworkStatus]:
    return Call("getNetwork", "GET", sandbox_path(sandbox_id, "/network"), _json(gen.NetworkStatus.from_json))


def set_network(sandbox_id: str, policy: gen.NetworkPolicy) -> Call[gen.NetworkStatus]:
    return Call("setNetwork", "PUT", sandbox_path(sandbox_id, "/network"), _json(gen.NetworkStatus.from_json), json=policy.to_json())


def get_limits(sandbox_id: str) -> Call[gen.Limits]:
    return Call("getLimits", "GET", sandbox_path(sandbox_id, "/limits"), _json(gen.Limits.from_json))


def set_limits(sandbox_id: str, limits: gen.Limits) -> Call[gen.Limits]:
    return Call("setLimits", "PUT", sandbox_path(sandbox_id, "/limits"), _json(gen.Limits.from_json), json=limits.to_json())


# Snapshots ---------------------------------------------------------------

def create_snapshot(sandbox_id: str, idempotency_key: Optional[str], name: Optional[str] = None) -> Call[gen.Snapshot]:
    body = gen.CreateSnapshotBody(name=name).to_json()
    return Call("createSnapshot", "POST", sandbox_path(sandbox_id, "/snapshots"), _json(gen.Snapshot.from_json),
                headers=idempotency_headers(idempotency_key), json=body)


def list_snapshots(sandbox_id: Optional[str], name: Optional[str] = None) -> Call[List[gen.Snapshot]]:
    return Call("listSnapshots", "GET", "/v1/snapshots", lambda r: gen.Snapshots.from_json(r.json()).snapshots,
                params=without_none(sandbox_id=sandbox_id, name=name))


def get_snapshot(snapshot_id: str) -> Call[gen.Snapshot]:
    return Call("getSnapshot", "GET", f"/v1/snapshots/{_segment(snapshot_id)}", _json(gen.Snapshot.from_json))


def delete_snapshot(snapshot_id: str) -> Call[None]:
    return Call("deleteSnapshot", "DELETE", f"/v1/snapshots/{_segment(snapshot_id)}", _nothing)


# Volumes -----------------------------------------------------------------

def list_volumes() -> Call[List[gen.Volume]]:
    return Call("listVolumes", "GET", "/v1/volumes", _json_list(gen.Volume.from_json))


def create_volume(name: str, size_mb: Optional[int]) -> Call[gen.Volume]:
    body = gen.CreateVolumeBody(name=name, size_mb=size_mb).to_json()
    return Call("createVolume", "POST", "/v1/volumes", _json(gen.Volume.from_json), json=body)


def get_volume(name: str) -> Call[gen.Volume]:
    return Call("getVolume", "GET", f"/v1/volumes/{_segment(name)}", _json(gen.Volume.from_json))


def delete_volume(name: str) -> Call[None]:
    return Call("deleteVolume", "DELETE", f"/v1/volumes/{_segment(name)}", _nothing)


def resize_volume(name: str, size_mb: int) -> Call[gen.Volume]:
    return Call("resizeVolume", "PATCH", f"/v1/volumes/{_segment(name)}", _json(gen.Volume.from_json), json={"size_mb": size_mb})


# Databases ---------------------------------------------------------------

def database_path(database_id: str, rest: str = "") -> str:
    return f"/v1/databases/{_segment(database_id)}{rest}"


def list_databases() -> Call[List[gen.DatabaseInfo]]:
    return Call("listDatabases", "GET", "/v1/databases", lambda r: gen.DatabaseList.from_json(r.json()).items)


def create_database(body: gen.CreateDatabaseBody) -> Call[gen.DatabaseInfo]:
    # No Idempotency-Key (the route takes none): a create is sent once.
    return Call("createDatabase", "POST", "/v1/databases", _json(gen.DatabaseInfo.from_json), json=body.to_json(),
                timeout=CREATE_TIMEOUT)


def get_database(database_id: str) -> Call[gen.DatabaseInfo]:
    return Call("getDatabase", "GET", database_path(database_id), _json(gen.DatabaseInfo.from_json))


def update_database(database_id: str, always_on: Optional[bool]) -> Call[gen.DatabaseInfo]:
    body = gen.PatchDatabaseBody(always_on=always_on).to_json()
    return Call("updateDatabase", "PATCH", database_path(database_id), _json(gen.DatabaseInfo.from_json), json=body)


def delete_database(database_id: str) -> Call[None]:
    return Call("deleteDatabase", "DELETE", database_path(database_id), _nothing)


def database_connection(database_id: str) -> Call[gen.ConnectionInfo]:
    return Call("databaseConnection", "GET", database_path(database_id, "/connection"), _json(gen.ConnectionInfo.from_json))


def reset_database_credentials(database_id: str) -> Call[gen.DatabaseInfo]:
    return Call("resetDatabaseCredentials", "POST", database_path(database_id, "/reset-credentials"), _json(gen.DatabaseInfo.from_json))


def wake_database(database_id: str) -> Call[str]:
    return Call("wakeDatabase", "POST", database_path(database_id, "/wake"), lambda r: gen.WakeStatus.from_json(r.json()).status)


def clone_database(database_id: str, label: Optional[str], size: Optional[str], target_time: Optional[str]) -> Call[gen.DatabaseInfo]:
    body = gen.CloneBody(label=label, size=size, target_time=target_time).to_json()
    return Call("cloneDatabase", "POST", database_path(database_id, "/clone"), _json(gen.DatabaseInfo.from_json), json=body)


def failover_database(database_id: str) -> Call[gen.DatabaseInfo]:
    return Call("failoverDatabase", "POST", database_path(database_id, "/failover"), _json(gen.DatabaseInfo.from_json))


def database_stats(database_id: str) -> Call[DatabaseStats]:
    return Call("databaseStats", "GET", database_path(database_id, "/stats"), _json(DatabaseStats.from_json))


def database_logs(database_id: str) -> Call[str]:
    return Call("databaseLogs", "GET", database_path(database_id, "/logs"), lambda r: gen.DatabaseLogs.from_json(r.json()).logs)


def database_query(database_id: str, sql: str, params: Optional[Sequence[Any]], broker_token: str) -> Call[gen.QueryResult]:
    """The broker is opened by the database's broker token, which replaces
    the client's API key on this request."""
    body = gen.QueryRequest(sql=sql, params=None if params is None else list(params)).to_json()
    return Call("databaseQuery", "POST", database_path(database_id, "/proxy"), _json(gen.QueryResult.from_json), json=body,
                headers={"Authorization": f"Bearer {broker_token}"})


# Functions and schedules -------------------------------------------------

#: How long an invoke's (or a trigger's) answer is waited for unless told:
#: a run may last 900 s, and a deploy in progress is waited for first.
INVOKE_TIMEOUT = 960.0


def function_path(function_id: str, rest: str = "") -> str:
    return f"/v1/functions/{_segment(function_id)}{rest}"


def schedule_path(schedule_id: str, rest: str = "") -> str:
    return f"/v1/schedules/{_segment(schedule_id)}{rest}"


def _runs(response: httpx.Response) -> List[gen.FunctionRun]:
    return gen.FunctionRunList.from_json(response.json()).items


def list_functions() -> Call[List[gen.FunctionInfo]]:
    return Call("listFunctions", "GET", "/v1/functions", lambda r: gen.FunctionList.from_json(r.json()).items)


def create_function(body: gen.CreateFunctionBody) -> Call[gen.FunctionInfo]:
    # No Idempotency-Key (the route takes none): a create is sent once.
    return Call("createFunction", "POST", "/v1/functions", _json(gen.FunctionInfo.from_json), json=body.to_json())


def get_function(function_id: str) -> Call[gen.FunctionInfo]:
    return Call("getFunction", "GET", function_path(function_id), _json(gen.FunctionInfo.from_json))


def update_function(function_id: str, body: gen.PatchFunctionBody) -> Call[gen.FunctionInfo]:
    return Call("updateFunction", "PATCH", function_path(function_id), _json(gen.FunctionInfo.from_json), json=body.to_json())


def delete_function(function_id: str) -> Call[None]:
    return Call("deleteFunction", "DELETE", function_path(function_id), _nothing)


def deploy_function(function_id: str, bundle: bytes, entrypoint: Optional[str]) -> Call[gen.FunctionInfo]:
    """The code as multipart: the tar.gz in the field `bundle`, and another `entrypoint`."""
    files = [("bundle", ("bundle.tar.gz", bundle, "application/gzip"))]
    return Call("deployFunction", "POST", function_path(function_id, "/deploy"), _json(gen.FunctionInfo.from_json),
                data=without_none(entrypoint=entrypoint), files=files)


def invoke_function(function_id: str, input: Any, request_timeout: Optional[float]) -> Call[gen.FunctionRun]:
    return Call("invokeFunction", "POST", function_path(function_id, "/invoke"), _json(gen.FunctionRun.from_json),
                json=gen.InvokeBody(input=input).to_json(), timeout=INVOKE_TIMEOUT if request_timeout is None else request_timeout)


def function_runs(function_id: str, limit: Optional[int]) -> Call[List[gen.FunctionRun]]:
    return Call("listFunctionRuns", "GET", function_path(function_id, "/runs"), _runs, params=without_none(limit=limit))


def record_function_run(function_id: str, body: gen.RecordRunBody) -> Call[gen.FunctionRun]:
    return Call("recordFunctionRun", "POST", function_path(function_id, "/runs"), _json(gen.FunctionRun.from_json), json=body.to_json())


def function_metrics(function_id: str, period_hours: int) -> Call[gen.Metrics]:
    return Call("functionMetrics", "GET", function_path(function_id, "/metrics"), _json(gen.Metrics.from_json),
                params={"period": period_hours})


def function_code(function_id: str) -> Call[bytes]:
    return Call("functionCode", "GET", function_path(function_id, "/code"), _bytes)


def list_schedules() -> Call[List[gen.ScheduleInfo]]:
    return Call("listSchedules", "GET", "/v1/schedules", lambda r: gen.ScheduleList.from_json(r.json()).items)


def create_schedule(body: gen.CreateScheduleBody) -> Call[gen.ScheduleInfo]:
    return Call("createSchedule", "POST", "/v1/schedules", _json(gen.ScheduleInfo.from_json), json=body.to_json())


def get_schedule(schedule_id: str) -> Call[gen.ScheduleInfo]:
    return Call("getSchedule", "GET", schedule_path(schedule_id), _json(gen.ScheduleInfo.from_json))


def update_schedule(schedule_id: str, body: gen.PatchScheduleBody) -> Call[gen.ScheduleInfo]:
    return Call("updateSchedule", "PATCH", schedule_path(schedule_id), _json(gen.ScheduleInfo.from_json), json=body.to_json())


def delete_schedule(schedule_id: str) -> Call[None]:
    return Call("deleteSchedule", "DELETE", schedule_path(schedule_id), _nothing)


def trigger_schedule(schedule_id: str, request_timeout: Optional[float]) -> Call[gen.FunctionRun]:
    return Call("triggerSchedule", "POST", schedule_path(schedule_id, "/trigger"), _json(gen.FunctionRun.from_json),
                timeout=INVOKE_TIMEOUT if request_timeout is None else request_timeout)


def schedule_runs(schedule_id: str, limit: Optional[int]) -> Call[List[gen.FunctionRun]]:
    return Call("listScheduleRuns", "GET", schedule_path(schedule_id, "/runs"), _runs, params=without_none(limit=limit))


# Apps --------------------------------------------------------------------

#: Seconds a deployment's log stream may stay silent unless told (httpx
#: times each read): its steps (fetch, install, build, start) may each take
#: minutes under emulation, and a proxy between may hold back keep-alives.
DEPLOY_LOGS_TIMEOUT = 1800.0


def app_path(app_id: str, rest: str = "") -> str:
    return f"/v1/apps/{_segment(app_id)}{rest}"


def deployment_path(app_id: str, deployment_id: str, rest: str = "") -> str:
    return app_path(app_id, f"/deploys/{_segment(deployment_id)}{rest}")


def list_apps() -> Call[List[gen.AppInfo]]:
    return Call("listApps", "GET", "/v1/apps", lambda r: gen.AppList.from_json(r.json()).items)


def create_app(body: gen.AppBody) -> Call[gen.AppInfo]:
    # No Idempotency-Key (the route takes none): a create is sent once.
    return Call("createApp", "POST", "/v1/apps", _json(gen.AppInfo.from_json), json=body.to_json())


def get_app(app_id: str) -> Call[gen.AppInfo]:
    return Call("getApp", "GET", app_path(app_id), _json(gen.AppInfo.from_json))


def update_app(app_id: str, body: gen.AppBody) -> Call[gen.AppInfo]:
    return Call("updateApp", "PATCH", app_path(app_id), _json(gen.AppInfo.from_json), json=body.to_json())


def delete_app(app_id: str) -> Call[None]:
    return Call("deleteApp", "DELETE", app_path(app_id), _nothing)


def deploy_app(app_id: str, git_ref: Optional[str]) -> Call[gen.DeploymentInfo]:
    return Call("deployApp", "POST", app_path(app_id, "/deploys"), _json(gen.DeploymentInfo.from_json),
                json=gen.DeployBody(git_ref=git_ref).to_json())


def list_deployments(app_id: str) -> Call[List[gen.DeploymentInfo]]:
    return Call("listDeployments", "GET", app_path(app_id, "/deploys"), lambda r: gen.DeploymentList.from_json(r.json()).items)


def get_deployment(app_id: str, deployment_id: str) -> Call[gen.DeploymentInfo]:
    return Call("getDeployment", "GET", deployment_path(app_id, deployment_id), _json(gen.DeploymentInfo.from_json))


def deployment_logs(app_id: str, deployment_id: str, request_timeout: Optional[float]) -> Call[httpx.Response]:
    return Call("deploymentLogs", "GET", deployment_path(app_id, deployment_id, "/logs"), _raw,
                headers={"Accept": "text/event-stream"},
                timeout=DEPLOY_LOGS_TIMEOUT if request_timeout is None else request_timeout)


def rollback_app(app_id: str) -> Call[gen.DeploymentInfo]:
    return Call("rollbackApp", "POST", app_path(app_id, "/rollback"), _json(gen.DeploymentInfo.from_json))


def list_app_env(app_id: str) -> Call[List[gen.AppEnvVar]]:
    return Call("listAppEnv", "GET", app_path(app_id, "/env"), lambda r: gen.AppEnvList.from_json(r.json()).env)


def set_app_env(app_id: str, key: str, body: gen.SetEnvBody) -> Call[gen.AppEnvSet]:
    return Call("setAppEnv", "PUT", app_path(app_id, f"/env/{_segment(key)}"), _json(gen.AppEnvSet.from_json), json=body.to_json())


def unset_app_env(app_id: str, key: str) -> Call[None]:
    return Call("unsetAppEnv", "DELETE", app_path(app_id, f"/env/{_segment(key)}"), _nothing)


def import_app_env(app_id: str, body: gen.ImportEnvBody) -> Call[gen.AppEnvImported]:
    return Call("importAppEnv", "POST", app_path(app_id, "/env/import"), _json(gen.AppEnvImported.from_json), json=body.to_json())


def app_runtime_logs(app_id: str, limit: Optional[int]) -> Call[str]:
    return Call("appRuntimeLogs", "GET", app_path(app_id, "/runtime-logs"), _text, params=without_none(limit=limit))


# Forks -------------------------------------------------------------------

def fork(sandbox_id: str, count: int, metadata: Optional[Mapping[str, str]], idempotency_key: Optional[str]) -> Call[gen.ForkResult]:
    body = gen.ForkBody(count=count, metadata=dict(metadata) if metadata else None).to_json()
    return Call("fork", "POST", sandbox_path(sandbox_id, "/fork"), _json(gen.ForkResult.from_json), json=body,
                headers=idempotency_headers(idempotency_key))


def fork_tree(sandbox_id: str, count: int, metadata: Optional[Mapping[str, str]], idempotency_key: Optional[str]) -> Call[gen.ForkTreeResult]:
    body = gen.ForkBody(count=count, metadata=dict(metadata) if metadata else None).to_json()
    return Call("forkTree", "POST", sandbox_path(sandbox_id, "/fork-tree"), _json(gen.ForkTreeResult.from_json), json=body,
                headers=idempotency_headers(idempotency_key))


def promote(sandbox_id: str, cleanup_siblings: Optional[bool], tree_id: Optional[str]) -> Call[gen.PromoteResult]:
    body = gen.PromoteBody(cleanup_siblings=cleanup_siblings, tree_id=tree_id).to_json()
    return Call("promote", "POST", sandbox_path(sandbox_id, "/promote"), _json(gen.PromoteResult.from_json), json=body)


# Ports and previews ------------------------------------------------------

def list_ports(sandbox_id: str) -> Call[List[gen.PortInfo]]:
    return Call("listPorts", "GET", sandbox_path(sandbox_id, "/ports"), _json_list(gen.PortInfo.from_json))


def add_port(sandbox_id: str, port: int, label: Optional[str]) -> Call[gen.PortInfo]:
    body = gen.AddPort(port=port, label=label).to_json()
    return Call("addPort", "POST", sandbox_path(sandbox_id, "/ports"), _json(gen.PortInfo.from_json), json=body)


def remove_port(sandbox_id: str, port: int) -> Call[None]:
    return Call("removePort", "DELETE", sandbox_path(sandbox_id, f"/ports/{int(port)}"), _nothing)


def create_preview_token(sandbox_id: str, port: Optional[int], ttl_seconds: Optional[int]) -> Call[gen.PreviewToken]:
    body = gen.PreviewTokenBody(port=port, ttl_seconds=ttl_seconds).to_json()
    return Call("createPreviewToken", "POST", sandbox_path(sandbox_id, "/preview-token"), _json(gen.PreviewToken.from_json), json=body)


def preview_url(base_url: str, sandbox_id: str, port: int) -> str:
    """`{scheme}://{port}-{id}.{suffix}[:listen port]`, the suffix derived from
    the API's host as the server does (an IP address or `localhost` gives
    `localhost`; a leading `api.` is dropped)."""
    url = httpx.URL(base_url)
    host = url.host.lower()
    try:
        ipaddress.ip_address(host)
        suffix = "localhost"
    except ValueError:
        suffix = host[len("api."):] if host.startswith("api.") and len(host) > 4 else (host or "localhost")
    default_port = {"http": 80, "https": 443}.get(url.scheme)
    listen = f":{url.port}" if url.port is not None and url.port != default_port else ""
    return f"{url.scheme}://{int(port)}-{sandbox_id}.{suffix}{listen}"

