"""Models of Clade's API, generated from docs/openapi.json by
sdk/python/scripts/generate_models.py. Do not edit: run the script."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional


class Model:
    """What every model shares: its JSON form, without the unset fields."""

    def to_json(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value is not None:
                body[field.metadata.get("json", field.name)] = _to_json(value)
        return body


def _to_json(value: Any) -> Any:
    if isinstance(value, Model):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    return value


@dataclasses.dataclass
class AddPort(Model):
    """A port to list, with its label."""

    port: Optional[int] = None
    label: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AddPort:
        return cls(
            port=data.get("port"),
            label=data.get("label"),
        )


@dataclasses.dataclass
class AppBody(Model):
    """An app's settings: a create's (`name` and `git_url` required) or a
    `PATCH`'s (each field given replaces the app's).
    """

    #: The first label of its host name: 1 to 40 lowercase letters, digits and `-`.
    name: Optional[str] = None
    #: `https://`, `ssh://` or `user@host:path` (`file://` where the server allows it).
    git_url: Optional[str] = None
    #: Default `main`.
    git_branch: Optional[str] = None
    #: `nextjs`, `vite`, `node`, `python`, `static` or `custom`; empty or absent: detected.
    framework: Optional[str] = None
    install_command: Optional[str] = None
    build_command: Optional[str] = None
    #: Run under `sh` in the app's directory with `$PORT` set.
    start_command: Optional[str] = None
    root_directory: Optional[str] = None
    #: Default 3000.
    port: Optional[int] = None
    #: Plain variables to set (secrets: `PUT …/env/{key}`).
    env: Optional[Dict[str, str]] = None
    template: Optional[str] = None
    cpu: Optional[int] = None
    memory_mb: Optional[int] = None
    #: Hibernate the live deployment after `idle_timeout_seconds` without requests (default false).
    auto_hibernate: Optional[bool] = None
    #: 10 to 604800 (default 600).
    idle_timeout_seconds: Optional[int] = None
    #: 0 to 20 (default 3).
    keep_deployments: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppBody:
        return cls(
            name=data.get("name"),
            git_url=data.get("git_url"),
            git_branch=data.get("git_branch"),
            framework=data.get("framework"),
            install_command=data.get("install_command"),
            build_command=data.get("build_command"),
            start_command=data.get("start_command"),
            root_directory=data.get("root_directory"),
            port=data.get("port"),
            env=None if data.get("env") is None else dict(data["env"]),
            template=data.get("template"),
            cpu=data.get("cpu"),
            memory_mb=data.get("memory_mb"),
            auto_hibernate=data.get("auto_hibernate"),
            idle_timeout_seconds=data.get("idle_timeout_seconds"),
            keep_deployments=data.get("keep_deployments"),
        )


@dataclasses.dataclass
class AppEnvImported(Model):
    """`AppEnvImported` in docs/openapi.json."""

    #: The variables the text set.
    imported: int
    #: The variables the app has now.
    total: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppEnvImported:
        return cls(
            imported=data["imported"],
            total=data["total"],
        )


@dataclasses.dataclass
class AppEnvList(Model):
    """`AppEnvList` in docs/openapi.json."""

    env: List[AppEnvVar]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppEnvList:
        return cls(
            env=[AppEnvVar.from_json(item) for item in data["env"]],
        )


@dataclasses.dataclass
class AppEnvSet(Model):
    """What setting a variable answers."""

    key: str
    secret: bool
    scope: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppEnvSet:
        return cls(
            key=data["key"],
            secret=data["secret"],
            scope=data["scope"],
        )


@dataclasses.dataclass
class AppEnvVar(Model):
    """One variable of an app's environment."""

    key: str
    #: A secret's is masked (`••••••••`).
    value: str
    secret: bool
    #: `all`, `production` or `preview` (which no deployment gets: there are no previews).
    scope: str
    #: RFC 3339.
    updated_at: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppEnvVar:
        return cls(
            key=data["key"],
            value=data["value"],
            secret=data["secret"],
            scope=data["scope"],
            updated_at=data["updated_at"],
        )


@dataclasses.dataclass
class AppInfo(Model):
    """An app (PandaStack's AppInfo)."""

    id: str
    #: The workspace's name.
    workspace: str
    #: Its host name's first label: unique on the server.
    name: str
    git_url: str
    git_branch: str
    #: The port its process listens on (it gets it as `$PORT`).
    port: int
    #: Its plain variables; a secret's value is masked.
    env: Dict[str, str]
    #: `created` (never deployed), `deploying`, `live` or `failed`.
    status: str
    #: Always false: deployments start from the API, the CLI or an SDK.
    auto_deploy: bool
    auto_hibernate: bool
    idle_timeout_seconds: int
    #: How many deployments before the live one keep their sandbox for a rollback.
    keep_deployments: int
    #: Always false: there are no pull-request previews.
    is_preview: bool
    #: RFC 3339.
    created_at: str
    updated_at: str
    #: Set by its owner (`nextjs`, `vite`, `node`, `python`, `static`, `custom`); absent: detected at each
    #: deployment.
    framework: Optional[str] = None
    install_command: Optional[str] = None
    build_command: Optional[str] = None
    start_command: Optional[str] = None
    root_directory: Optional[str] = None
    #: Its deployments' template; absent: the framework's (`agent` for Node.js, `base` otherwise).
    template: Optional[str] = None
    cpu: Optional[int] = None
    memory_mb: Optional[int] = None
    #: The live deployment's sandbox.
    sandbox_id: Optional[str] = None
    active_deployment_id: Optional[str] = None
    #: Its stable address, `http://{name}.{suffix}`, once a deployment is live.
    url: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppInfo:
        return cls(
            id=data["id"],
            workspace=data["workspace"],
            name=data["name"],
            git_url=data["git_url"],
            git_branch=data["git_branch"],
            port=data["port"],
            env=dict(data["env"]),
            status=data["status"],
            auto_deploy=data["auto_deploy"],
            auto_hibernate=data["auto_hibernate"],
            idle_timeout_seconds=data["idle_timeout_seconds"],
            keep_deployments=data["keep_deployments"],
            is_preview=data["is_preview"],
            created_at=data["created_at"],
            updated_at=data["updated_at"],
            framework=data.get("framework"),
            install_command=data.get("install_command"),
            build_command=data.get("build_command"),
            start_command=data.get("start_command"),
            root_directory=data.get("root_directory"),
            template=data.get("template"),
            cpu=data.get("cpu"),
            memory_mb=data.get("memory_mb"),
            sandbox_id=data.get("sandbox_id"),
            active_deployment_id=data.get("active_deployment_id"),
            url=data.get("url"),
        )


@dataclasses.dataclass
class AppList(Model):
    """`AppList` in docs/openapi.json."""

    items: List[AppInfo]
    count: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppList:
        return cls(
            items=[AppInfo.from_json(item) for item in data["items"]],
            count=data["count"],
        )


@dataclasses.dataclass
class Attachment(Model):
    """A sandbox that has the volume."""

    sandbox_id: str
    #: `rw` (its writer), `ro`, or `fork`: a fork child's or a snapshot's sandbox's private copy-on-write
    #: copy, which `promote` makes the volume.
    mode: str
    mount_path: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Attachment:
        return cls(
            sandbox_id=data["sandbox_id"],
            mode=data["mode"],
            mount_path=data.get("mount_path"),
        )


#: Bundle: raw bytes (docs/openapi.json)
Bundle = bytes


@dataclasses.dataclass
class ChildError(Model):
    """A child of a fork-tree that did not start: its index among the
    requested children (§3.9 `errors`).
    """

    index: int
    #: Why, as the API would have answered it.
    err: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ChildError:
        return cls(
            index=data["index"],
            err=data["err"],
        )


@dataclasses.dataclass
class CloneBody(Model):
    """`CloneBody` in docs/openapi.json."""

    label: Optional[str] = None
    #: RFC 3339: a clone as of that instant (point-in-time recovery from the source's base backup and WAL),
    #: not before its oldest backup kept.
    target_time: Optional[str] = None
    #: A clone keeps its source's size; another size is refused.
    size: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CloneBody:
        return cls(
            label=data.get("label"),
            target_time=data.get("target_time"),
            size=data.get("size"),
        )


@dataclasses.dataclass
class CodeContext(Model):
    """A code context."""

    id: str
    sandbox_id: str
    language: str
    #: RFC 3339.
    created_at: str
    #: Cells run so far (listing only).
    cells: Optional[int] = None
    #: False once its kernel died (listing only).
    alive: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CodeContext:
        return cls(
            id=data["id"],
            sandbox_id=data["sandbox_id"],
            language=data["language"],
            created_at=data["created_at"],
            cells=data.get("cells"),
            alive=data.get("alive"),
        )


@dataclasses.dataclass
class Column(Model):
    """A result column."""

    name: str
    #: PostgreSQL's name of its type: `int4`, `text`, `timestamptz`, …
    type_name: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Column:
        return cls(
            name=data["name"],
            type_name=data["type_name"],
        )


@dataclasses.dataclass
class ConnectionInfo(Model):
    """What `GET …/connection` answers."""

    connection_url: str
    broker_url: str
    broker_token: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConnectionInfo:
        return cls(
            connection_url=data["connection_url"],
            broker_url=data["broker_url"],
            broker_token=data["broker_token"],
        )


@dataclasses.dataclass
class CreateContextBody(Model):
    """`CreateContextBody` in docs/openapi.json."""

    #: `python` (default; also `py`, `python3`), `javascript` (`js`, `node`), `typescript` (`ts`) or `bash`
    #: (`sh`, `shell`).
    language: Optional[str] = None
    #: The context's working directory (default: the image's, else the user's home).
    cwd: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateContextBody:
        return cls(
            language=data.get("language"),
            cwd=data.get("cwd"),
        )


@dataclasses.dataclass
class CreateDatabaseBody(Model):
    """`CreateDatabaseBody` in docs/openapi.json."""

    #: `1g` (512 MiB of memory and a 4 GiB disk, the default), `4g` (1 GiB, 6 GiB) or `16g` (2 GiB, 18
    #: GiB).
    size: Optional[str] = None
    #: vCPUs, 1 to 8 (default 1).
    cpu: Optional[int] = None
    #: Memory in MiB, 256 to 16384, instead of the size's.
    memory_mb: Optional[int] = None
    label: Optional[str] = None
    #: Never idled into hibernation (default false).
    always_on: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateDatabaseBody:
        return cls(
            size=data.get("size"),
            cpu=data.get("cpu"),
            memory_mb=data.get("memory_mb"),
            label=data.get("label"),
            always_on=data.get("always_on"),
        )


@dataclasses.dataclass
class CreateFunctionBody(Model):
    """`CreateFunctionBody` in docs/openapi.json."""

    #: Unique in the workspace.
    name: str
    #: `python` or `nodejs`.
    runtime: str
    #: Default `handler.py` / `handler.js`.
    entrypoint: Optional[str] = None
    #: Base64 of one file (plain or gzip; it becomes the entrypoint) or of a tar.gz bundle, at most 512 KiB
    #: decoded. Without it, deploy code later.
    code: Optional[str] = None
    #: Default `code-interpreter` (Python 3 and Node.js).
    template: Optional[str] = None
    public: Optional[bool] = None
    env: Optional[Dict[str, str]] = None
    #: A run's time limit, 1 to 900 (default 300).
    timeout_seconds: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateFunctionBody:
        return cls(
            name=data["name"],
            runtime=data["runtime"],
            entrypoint=data.get("entrypoint"),
            code=data.get("code"),
            template=data.get("template"),
            public=data.get("public"),
            env=None if data.get("env") is None else dict(data["env"]),
            timeout_seconds=data.get("timeout_seconds"),
        )


@dataclasses.dataclass
class CreateSandboxBody(Model):
    """Every field is optional; an empty body creates a `base` sandbox."""

    #: An image name (`GET /v1/templates`); `base` when absent or empty.
    template: Optional[str] = None
    #: String values only; keys starting with `secret.` are write-only.
    metadata: Optional[Dict[str, str]] = None
    #: Idle time after which the sandbox is deleted (0: never).
    ttl_seconds: Optional[int] = None
    #: Hibernated when idle instead of deleted.
    persistent: Optional[bool] = None
    #: A persistent sandbox's idle time before it is hibernated (default 300; 0: never).
    hibernate_after_seconds: Optional[int] = None
    #: Whether that idle hibernation keeps the memory (default true); false keeps only the disk, and the
    #: wake boots it (see `POST …/hibernate`).
    hibernate_memory: Optional[bool] = None
    #: A snapshot id to create the sandbox from.
    from_snapshot: Optional[str] = None
    network: Optional[NetworkPolicy] = None
    #: Volumes (`POST /v1/volumes`) behind its disks, in order: `/dev/vdb`, `/dev/vdc`, … (at most 4).
    volumes: Optional[List[VolumeAttachment]] = None
    #: Preview hosts need a signed token (default: public, as in PandaStack).
    preview_auth: Optional[bool] = None
    limits: Optional[Limits] = None
    #: The default environment of its commands (a command's own `env` wins); not with `from_snapshot`,
    #: which keeps the snapshot's.
    env: Optional[Dict[str, str]] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateSandboxBody:
        return cls(
            template=data.get("template"),
            metadata=None if data.get("metadata") is None else dict(data["metadata"]),
            ttl_seconds=data.get("ttl_seconds"),
            persistent=data.get("persistent"),
            hibernate_after_seconds=data.get("hibernate_after_seconds"),
            hibernate_memory=data.get("hibernate_memory"),
            from_snapshot=data.get("from_snapshot"),
            network=None if data.get("network") is None else NetworkPolicy.from_json(data["network"]),
            volumes=None if data.get("volumes") is None else [VolumeAttachment.from_json(item) for item in data["volumes"]],
            preview_auth=data.get("preview_auth"),
            limits=None if data.get("limits") is None else Limits.from_json(data["limits"]),
            env=None if data.get("env") is None else dict(data["env"]),
        )


@dataclasses.dataclass
class CreateScheduleBody(Model):
    """`CreateScheduleBody` in docs/openapi.json."""

    #: Unique in the workspace.
    name: str
    #: A function of the workspace (its id or name).
    function_id: str
    #: Five fields, such as `0 9 * * 1-5`, or `@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`.
    cron: str
    #: An IANA time zone, such as `Europe/Paris` (default `UTC`).
    timezone: Optional[str] = None
    paused: Optional[bool] = None
    #: Given to each run as its input.
    input: Any = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateScheduleBody:
        return cls(
            name=data["name"],
            function_id=data["function_id"],
            cron=data["cron"],
            timezone=data.get("timezone"),
            paused=data.get("paused"),
            input=data.get("input"),
        )


@dataclasses.dataclass
class CreateSnapshotBody(Model):
    """`POST /v1/sandboxes/{id}/snapshots`; an empty body is no name."""

    #: A name for it, unique in the workspace: 1 to 128 letters, digits, `.`, `_` and `-`, beginning with a
    #: letter or a digit.
    name: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateSnapshotBody:
        return cls(
            name=data.get("name"),
        )


@dataclasses.dataclass
class CreateToken(Model):
    """`CreateToken` in docs/openapi.json."""

    #: The key's name (`api` when absent), at most 200 bytes.
    label: Optional[str] = None
    #: The same as `label`, which wins.
    name: Optional[str] = None
    #: Days until the key stops working (1 to 3650); absent or null for a key valid until revoked.
    expires_in_days: Optional[int] = None
    #: How the key is spelled: `clade` (default, `clade_…`) or `e2b` (`e2b_` and 40 hex digits, for E2B's
    #: SDKs).
    format: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateToken:
        return cls(
            label=data.get("label"),
            name=data.get("name"),
            expires_in_days=data.get("expires_in_days"),
            format=data.get("format"),
        )


@dataclasses.dataclass
class CreateVolumeBody(Model):
    """`CreateVolumeBody` in docs/openapi.json."""

    #: 1 to 63 letters, digits, `.`, `_` or `-`, starting with a letter or digit.
    name: Optional[str] = None
    #: 16 to 65536; 256 when absent.
    size_mb: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CreateVolumeBody:
        return cls(
            name=data.get("name"),
            size_mb=data.get("size_mb"),
        )


@dataclasses.dataclass
class Credentials(Model):
    """How to reach a ready database: every field is absent from lists, and
    until it is ready (so a flattened empty value adds nothing to the answer).
    """

    #: The endpoint's host for this database: `<id>.db.<suffix>` (the TLS server name it is routed by).
    host: Optional[str] = None
    port: Optional[int] = None
    database: Optional[str] = None
    username: Optional[str] = None
    password: Optional[str] = None
    #: `postgresql://…?sslmode=require` (with `hostaddr` when the host name is a local one that may not
    #: resolve).
    connection_url: Optional[str] = None
    #: `POST` a query here with `Authorization: Bearer <broker_token>`.
    broker_url: Optional[str] = None
    broker_token: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Credentials:
        return cls(
            host=data.get("host"),
            port=data.get("port"),
            database=data.get("database"),
            username=data.get("username"),
            password=data.get("password"),
            connection_url=data.get("connection_url"),
            broker_url=data.get("broker_url"),
            broker_token=data.get("broker_token"),
        )


@dataclasses.dataclass
class DatabaseInfo(Model):
    """A managed PostgreSQL database (PandaStack's DatabaseInfo)."""

    id: str
    #: `provisioning`, `running`, `hibernated` (a connection wakes it) or `failed`.
    status: str
    #: The template its sandbox is of (`postgres`: PostgreSQL 15, Debian's).
    template: str
    #: PostgreSQL's major version.
    postgres_version: str
    #: Unix seconds.
    created_at: int
    #: `1g`, `4g` or `16g`.
    size: str
    cpu: int
    memory_mb: int
    #: Never idled into hibernation.
    always_on: bool
    #: A base backup exists to rebuild it from (`POST …/failover`) and to clone it from as of an earlier
    #: instant (`target_time`).
    failover_available: bool
    label: Optional[str] = None
    #: The sandbox that runs its server (of the same workspace).
    sandbox_id: Optional[str] = None
    cloned_from: Optional[str] = None
    #: Why it failed.
    error: Optional[str] = None
    failover_reason: Optional[str] = None
    #: The endpoint's host for this database: `<id>.db.<suffix>` (the TLS server name it is routed by).
    host: Optional[str] = None
    port: Optional[int] = None
    database: Optional[str] = None
    username: Optional[str] = None
    password: Optional[str] = None
    #: `postgresql://…?sslmode=require` (with `hostaddr` when the host name is a local one that may not
    #: resolve).
    connection_url: Optional[str] = None
    #: `POST` a query here with `Authorization: Bearer <broker_token>`.
    broker_url: Optional[str] = None
    broker_token: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DatabaseInfo:
        return cls(
            id=data["id"],
            status=data["status"],
            template=data["template"],
            postgres_version=data["postgres_version"],
            created_at=data["created_at"],
            size=data["size"],
            cpu=data["cpu"],
            memory_mb=data["memory_mb"],
            always_on=data["always_on"],
            failover_available=data["failover_available"],
            label=data.get("label"),
            sandbox_id=data.get("sandbox_id"),
            cloned_from=data.get("cloned_from"),
            error=data.get("error"),
            failover_reason=data.get("failover_reason"),
            host=data.get("host"),
            port=data.get("port"),
            database=data.get("database"),
            username=data.get("username"),
            password=data.get("password"),
            connection_url=data.get("connection_url"),
            broker_url=data.get("broker_url"),
            broker_token=data.get("broker_token"),
        )


@dataclasses.dataclass
class DatabaseList(Model):
    """What `GET /v1/databases` answers."""

    items: List[DatabaseInfo]
    count: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DatabaseList:
        return cls(
            items=[DatabaseInfo.from_json(item) for item in data["items"]],
            count=data["count"],
        )


@dataclasses.dataclass
class DatabaseLogs(Model):
    """`DatabaseLogs` in docs/openapi.json."""

    #: The end of the server's log (at most 256 KiB).
    logs: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DatabaseLogs:
        return cls(
            logs=data["logs"],
        )


@dataclasses.dataclass
class DeployBody(Model):
    """`DeployBody` in docs/openapi.json."""

    #: A branch, tag or commit; default the app's branch.
    git_ref: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeployBody:
        return cls(
            git_ref=data.get("git_ref"),
        )


@dataclasses.dataclass
class DeployForm(Model):
    """The multipart form of a deploy: the schema of its body only."""

    #: The code: a tar.gz, at most 16 MiB.
    bundle: Bundle
    #: Another entrypoint in the bundle.
    entrypoint: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeployForm:
        return cls(
            bundle=data["bundle"],
            entrypoint=data.get("entrypoint"),
        )


@dataclasses.dataclass
class DeploymentInfo(Model):
    """A deployment of an app (PandaStack's DeploymentInfo)."""

    id: str
    app_id: str
    workspace: str
    #: `queued`, `building`, `deploying`, then `live`, `failed`, `superseded` or `rolled_back`.
    status: str
    #: The branch, tag or commit it was asked for.
    git_ref: str
    #: RFC 3339.
    created_at: str
    updated_at: str
    #: The commit it cloned.
    git_commit: Optional[str] = None
    #: The framework it was built as.
    framework: Optional[str] = None
    #: The sandbox that runs it, while it is kept.
    sandbox_id: Optional[str] = None
    #: What its clone, install, build and start printed (only in `GET …/deploys/{dep}`).
    build_logs: Optional[str] = None
    #: Why it failed.
    error: Optional[str] = None
    finished_at: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeploymentInfo:
        return cls(
            id=data["id"],
            app_id=data["app_id"],
            workspace=data["workspace"],
            status=data["status"],
            git_ref=data["git_ref"],
            created_at=data["created_at"],
            updated_at=data["updated_at"],
            git_commit=data.get("git_commit"),
            framework=data.get("framework"),
            sandbox_id=data.get("sandbox_id"),
            build_logs=data.get("build_logs"),
            error=data.get("error"),
            finished_at=data.get("finished_at"),
        )


@dataclasses.dataclass
class DeploymentList(Model):
    """`DeploymentList` in docs/openapi.json."""

    items: List[DeploymentInfo]
    count: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeploymentList:
        return cls(
            items=[DeploymentInfo.from_json(item) for item in data["items"]],
            count=data["count"],
        )


@dataclasses.dataclass
class DirListing(Model):
    """`DirListing` in docs/openapi.json."""

    path: str
    #: Sorted by name.
    entries: List[FileEntry]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DirListing:
        return cls(
            path=data["path"],
            entries=[FileEntry.from_json(item) for item in data["entries"]],
        )


@dataclasses.dataclass
class ErrorBody(Model):
    """The body of every error response (§2.4)."""

    #: What went wrong; for a 4xx, also how to fix it. `unauthorized` for a 401.
    error: str
    #: The request's id, also in the `X-Request-Id` header.
    request_id: str
    #: Why a 401 was refused.
    detail: Optional[str] = None
    #: The workspace whose sandbox quota a 429 refers to.
    workspace: Optional[str] = None
    #: Why a 507 was refused (what the host lacks), as PandaStack's body has it.
    reason: Optional[str] = None
    #: What may help after a 507.
    hint: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ErrorBody:
        return cls(
            error=data["error"],
            request_id=data["request_id"],
            detail=data.get("detail"),
            workspace=data.get("workspace"),
            reason=data.get("reason"),
            hint=data.get("hint"),
        )


@dataclasses.dataclass
class Event(Model):
    """One entry of a sandbox's event log (§3.19)."""

    #: RFC 3339.
    time: str
    sandbox_id: str
    #: `created`, `exec`, `paused`, `resumed`, `hibernated`, `woken`, `adopted`, `lifecycle`, `failed`,
    #: `reaped`, `deleted`…
    type: str
    #: What the event carries; its shape depends on `type`.
    payload: Any

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        return cls(
            time=data["time"],
            sandbox_id=data["sandbox_id"],
            type=data["type"],
            payload=data["payload"],
        )


@dataclasses.dataclass
class Events(Model):
    """`Events` in docs/openapi.json."""

    events: List[Event]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Events:
        return cls(
            events=[Event.from_json(item) for item in data["events"]],
        )


@dataclasses.dataclass
class ExecBody(Model):
    """A shell command (`sh -c`) and its timeout."""

    #: Required, not blank.
    cmd: str
    #: The server's default (300 s) when absent or 0; at most 86400.
    timeout_seconds: Optional[int] = None
    #: Variables added to (and overriding) the sandbox's environment.
    env: Optional[Dict[str, str]] = None
    #: An absolute working directory; the user's home when absent.
    cwd: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExecBody:
        return cls(
            cmd=data["cmd"],
            timeout_seconds=data.get("timeout_seconds"),
            env=None if data.get("env") is None else dict(data["env"]),
            cwd=data.get("cwd"),
        )


@dataclasses.dataclass
class ExecResult(Model):
    """A finished command (§3.3)."""

    stdout: str
    stderr: str
    #: The shell's exit code (128 + n for a signal).
    exit_code: int
    duration_ms: int
    truncated: Optional[Truncated] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExecResult:
        return cls(
            stdout=data["stdout"],
            stderr=data["stderr"],
            exit_code=data["exit_code"],
            duration_ms=data["duration_ms"],
            truncated=None if data.get("truncated") is None else Truncated.from_json(data["truncated"]),
        )


@dataclasses.dataclass
class Execution(Model):
    """A cell's outcome (§3.4)."""

    stdout: str
    stderr: str
    #: 0, or 1 when the cell raised or was interrupted (bash: its status).
    exit: int
    exit_code: int
    duration_ms: int
    #: One MIME bundle per display, the last expression's value included (`text/plain`, `text/html`,
    #: `text/markdown`, `image/png` and `image/jpeg` as base64, `image/svg+xml`, `application/json` as a
    #: string).
    results: List[Dict[str, Any]]
    #: The formatted traceback (or `Name: value`) when the cell raised.
    error: Optional[str] = None
    #: Output beyond the cell's limits (1 MiB of text, 8 MiB of results) was dropped.
    truncated: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Execution:
        return cls(
            stdout=data["stdout"],
            stderr=data["stderr"],
            exit=data["exit"],
            exit_code=data["exit_code"],
            duration_ms=data["duration_ms"],
            results=[dict(item) for item in data["results"]],
            error=data.get("error"),
            truncated=data.get("truncated"),
        )


#: FileBytes: raw bytes (docs/openapi.json)
FileBytes = bytes


@dataclasses.dataclass
class FileEntry(Model):
    """A file, directory or link (§3.5)."""

    name: str
    path: str
    is_dir: bool
    size: int
    #: `f` file, `d` directory, `l` symlink, `o` other.
    mode: str
    #: Octal, e.g. `0644`.
    permissions: str
    #: Unix seconds.
    mtime: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileEntry:
        return cls(
            name=data["name"],
            path=data["path"],
            is_dir=data["is_dir"],
            size=data["size"],
            mode=data["mode"],
            permissions=data["permissions"],
            mtime=data["mtime"],
        )


@dataclasses.dataclass
class ForkBody(Model):
    """`ForkBody` in docs/openapi.json."""

    #: The children's metadata (string values only).
    metadata: Optional[Dict[str, str]] = None
    #: How many children (fork: 1 when absent or 0; fork-tree: 2); at most 16.
    count: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ForkBody:
        return cls(
            metadata=None if data.get("metadata") is None else dict(data["metadata"]),
            count=data.get("count"),
        )


@dataclasses.dataclass
class ForkResult(Model):
    """The answer of a fork."""

    #: The first child.
    sandbox: Sandbox
    children: List[Sandbox]
    parent_id: str
    #: RFC 3339: when the parent was captured.
    at: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ForkResult:
        return cls(
            sandbox=Sandbox.from_json(data["sandbox"]),
            children=[Sandbox.from_json(item) for item in data["children"]],
            parent_id=data["parent_id"],
            at=data["at"],
        )


@dataclasses.dataclass
class ForkTreeResult(Model):
    """The answer of a fork-tree."""

    parent_id: str
    #: RFC 3339: when the parent was captured.
    at: str
    children: List[Sandbox]
    #: The children that failed to start (their `fork_index` is missing among `children`); the others run.
    #: Empty when all started.
    errors: List[ChildError]
    tree_id: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ForkTreeResult:
        return cls(
            parent_id=data["parent_id"],
            at=data["at"],
            children=[Sandbox.from_json(item) for item in data["children"]],
            errors=[ChildError.from_json(item) for item in data["errors"]],
            tree_id=data.get("tree_id"),
        )


@dataclasses.dataclass
class FunctionInfo(Model):
    """A function (PandaStack's FunctionInfo)."""

    id: str
    #: The workspace's name.
    workspace: str
    name: str
    #: `python` or `nodejs`.
    runtime: str
    #: The file run, relative to the code's root.
    entrypoint: str
    #: The size of the code as it was given, in bytes.
    code_size: int
    #: The template its sandboxes are made of.
    template: str
    #: Its runs' environment.
    env: Dict[str, str]
    #: Answers HTTP at `url` without an API key.
    public: bool
    #: Counts its code's changes.
    version: int
    #: Its code is deployed: invokes run it.
    is_ready: bool
    #: `empty` (no code yet), `deploying`, `ready` or `failed`.
    status: str
    #: A run's time limit.
    timeout_seconds: int
    #: RFC 3339.
    created_at: str
    updated_at: str
    #: A public function's address: `http://{id}.{suffix}`.
    url: Optional[str] = None
    #: The same as `url`.
    endpoint: Optional[str] = None
    #: Why its last deploy failed.
    error: Optional[str] = None
    #: The end of its last deploy's install output.
    deploy_log: Optional[str] = None
    #: The snapshot its runs restore (named `{id}-v{version}` in the workspace's snapshots).
    snapshot_id: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FunctionInfo:
        return cls(
            id=data["id"],
            workspace=data["workspace"],
            name=data["name"],
            runtime=data["runtime"],
            entrypoint=data["entrypoint"],
            code_size=data["code_size"],
            template=data["template"],
            env=dict(data["env"]),
            public=data["public"],
            version=data["version"],
            is_ready=data["is_ready"],
            status=data["status"],
            timeout_seconds=data["timeout_seconds"],
            created_at=data["created_at"],
            updated_at=data["updated_at"],
            url=data.get("url"),
            endpoint=data.get("endpoint"),
            error=data.get("error"),
            deploy_log=data.get("deploy_log"),
            snapshot_id=data.get("snapshot_id"),
        )


@dataclasses.dataclass
class FunctionList(Model):
    """`FunctionList` in docs/openapi.json."""

    items: List[FunctionInfo]
    count: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FunctionList:
        return cls(
            items=[FunctionInfo.from_json(item) for item in data["items"]],
            count=data["count"],
        )


@dataclasses.dataclass
class FunctionRun(Model):
    """One run of a function (PandaStack's FunctionRun)."""

    id: str
    workspace: str
    function_id: str
    #: `running`, `success`, `error`, `timeout`, or `skipped` (a scheduled run the servers missed).
    status: str
    #: `invoke`, `http`, `schedule` or `recorded`.
    invoked_by: str
    #: Its sandbox was restored from the function's snapshot for it.
    cold_start: bool
    #: RFC 3339.
    started_at: str
    schedule_id: Optional[str] = None
    sandbox_id: Optional[str] = None
    exit_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None
    #: What the entrypoint's `handler` returned (JSON), when it has one.
    output: Any = None
    duration_ms: Optional[int] = None
    ended_at: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FunctionRun:
        return cls(
            id=data["id"],
            workspace=data["workspace"],
            function_id=data["function_id"],
            status=data["status"],
            invoked_by=data["invoked_by"],
            cold_start=data["cold_start"],
            started_at=data["started_at"],
            schedule_id=data.get("schedule_id"),
            sandbox_id=data.get("sandbox_id"),
            exit_code=data.get("exit_code"),
            stdout=data.get("stdout"),
            stderr=data.get("stderr"),
            output=data.get("output"),
            duration_ms=data.get("duration_ms"),
            ended_at=data.get("ended_at"),
        )


@dataclasses.dataclass
class FunctionRunList(Model):
    """`FunctionRunList` in docs/openapi.json."""

    items: List[FunctionRun]
    count: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FunctionRunList:
        return cls(
            items=[FunctionRun.from_json(item) for item in data["items"]],
            count=data["count"],
        )


@dataclasses.dataclass
class Health(Model):
    """`Health` in docs/openapi.json."""

    #: `ok`.
    status: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Health:
        return cls(
            status=data["status"],
        )


@dataclasses.dataclass
class HibernateBody(Model):
    """What a hibernation keeps; an empty body keeps everything."""

    #: Keep the memory (default true): the wake restores the sandbox as it was, processes and all. False
    #: keeps only the disk (a filesystem-only pause): nothing of the memory is saved and the wake boots the
    #: disk, as a reboot would, with the sandbox's id, variables, network and volumes; what ran is gone.
    #: The guest must answer for it (a 503 otherwise, and the sandbox runs on).
    memory: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HibernateBody:
        return cls(
            memory=data.get("memory"),
        )


@dataclasses.dataclass
class ImportEnvBody(Model):
    """`ImportEnvBody` in docs/openapi.json."""

    #: `KEY=value` lines (`#` comments, blank lines, `export` and quotes as in shells). Required.
    dotenv: Optional[str] = None
    secret: Optional[bool] = None
    scope: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImportEnvBody:
        return cls(
            dotenv=data.get("dotenv"),
            secret=data.get("secret"),
            scope=data.get("scope"),
        )


@dataclasses.dataclass
class InvokeBody(Model):
    """`InvokeBody` in docs/openapi.json."""

    #: Given to the function as JSON: on its stdin, and as the `event` of its `handler`.
    input: Any = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InvokeBody:
        return cls(
            input=data.get("input"),
        )


@dataclasses.dataclass
class KeyRef(Model):
    """`KeyRef` in docs/openapi.json."""

    id: str
    prefix: str
    name: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KeyRef:
        return cls(
            id=data["id"],
            prefix=data["prefix"],
            name=data["name"],
        )


@dataclasses.dataclass
class LifecyclePatch(Model):
    """At least one field."""

    ttl_seconds: Optional[int] = None
    persistent: Optional[bool] = None
    hibernate_after_seconds: Optional[int] = None
    hibernate_memory: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LifecyclePatch:
        return cls(
            ttl_seconds=data.get("ttl_seconds"),
            persistent=data.get("persistent"),
            hibernate_after_seconds=data.get("hibernate_after_seconds"),
            hibernate_memory=data.get("hibernate_memory"),
        )


@dataclasses.dataclass
class LifecycleSettings(Model):
    """A sandbox's idle settings (§3.7)."""

    #: Idle time after which a non-persistent sandbox is deleted (0: never).
    ttl_seconds: int
    #: A persistent sandbox is hibernated when idle instead of deleted.
    persistent: bool
    #: A persistent sandbox's idle time before it is hibernated (its own, else the server's; 0: never).
    hibernate_after_seconds: int
    #: Whether that hibernation keeps the memory (else only the disk, and the wake boots it).
    hibernate_memory: bool
    idle_seconds: int
    #: When it was last used (RFC 3339, milliseconds): the idle limits run from here, so it ends (or
    #: hibernates) at this plus its limit if left alone.
    last_used_at: str
    status: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LifecycleSettings:
        return cls(
            ttl_seconds=data["ttl_seconds"],
            persistent=data["persistent"],
            hibernate_after_seconds=data["hibernate_after_seconds"],
            hibernate_memory=data["hibernate_memory"],
            idle_seconds=data["idle_seconds"],
            last_used_at=data["last_used_at"],
            status=data["status"],
        )


@dataclasses.dataclass
class LifecycleStatus(Model):
    """The state a lifecycle change left the sandbox in."""

    #: `hibernated` or `running`.
    status: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LifecycleStatus:
        return cls(
            status=data["status"],
        )


@dataclasses.dataclass
class Limits(Model):
    """Limits on every command of a sandbox together; an absent field is left
    as it is. Defaults: the sandbox's memory less what its agent and kernel
    keep (an eighth, 32–128 MiB), and 1024 processes.
    """

    #: Memory of all commands together, MiB (page cache included): at least 16, at most the sandbox's
    #: memory less what its agent keeps. Beyond it, the guest's OOM killer ends one of the commands'
    #: processes.
    memory_mb: Optional[int] = None
    #: Processes and threads of all commands together; beyond it `fork` fails (`EAGAIN`). At most the
    #: guest's `kernel.pid_max` (32768 by default).
    max_processes: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Limits:
        return cls(
            memory_mb=data.get("memory_mb"),
            max_processes=data.get("max_processes"),
        )


@dataclasses.dataclass
class Me(Model):
    """The caller: its key and workspace (§3.1)."""

    #: The key's id (there are no user accounts).
    user_id: str
    #: Always empty.
    email: str
    #: `token`.
    auth_method: str
    workspace: WorkspaceRef
    current_org: WorkspaceRef
    orgs: List[WorkspaceRef]
    key: KeyRef

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Me:
        return cls(
            user_id=data["user_id"],
            email=data["email"],
            auth_method=data["auth_method"],
            workspace=WorkspaceRef.from_json(data["workspace"]),
            current_org=WorkspaceRef.from_json(data["current_org"]),
            orgs=[WorkspaceRef.from_json(item) for item in data["orgs"]],
            key=KeyRef.from_json(data["key"]),
        )


@dataclasses.dataclass
class Metrics(Model):
    """What `GET …/metrics` answers."""

    #: The hours looked back over.
    period: int
    total: int
    #: Runs that did not succeed (an error or a timeout).
    errors: int
    error_rate: float
    p50_ms: int
    p95_ms: int
    p99_ms: int
    #: The share of runs whose sandbox was restored for them.
    cold_start_rate: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Metrics:
        return cls(
            period=data["period"],
            total=data["total"],
            errors=data["errors"],
            error_rate=data["error_rate"],
            p50_ms=data["p50_ms"],
            p95_ms=data["p95_ms"],
            p99_ms=data["p99_ms"],
            cold_start_rate=data["cold_start_rate"],
        )


@dataclasses.dataclass
class NetworkPolicy(Model):
    """What a sandbox may reach. Every field is optional; absent fields take
    their defaults (the internet yes; private ranges, the host, other
    sandboxes and link-local addresses never, unless a CIDR allows a private range).
    """

    #: Whether addresses no list names are reachable (default true).
    internet: Optional[bool] = None
    #: IPv4 addresses or CIDRs that are reachable whatever else says (allow wins over deny).
    allow_cidrs: Optional[List[str]] = None
    #: IPv4 addresses or CIDRs that are refused.
    deny_cidrs: Optional[List[str]] = None
    #: Names (`example.com`) and wildcards (`*.example.com`, subdomains only): only these resolve, and only
    #: the addresses they resolved to are reachable.
    allow_domains: Optional[List[str]] = None
    #: Most connections open at once (default 1024).
    max_connections: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NetworkPolicy:
        return cls(
            internet=data.get("internet"),
            allow_cidrs=None if data.get("allow_cidrs") is None else list(data["allow_cidrs"]),
            deny_cidrs=None if data.get("deny_cidrs") is None else list(data["deny_cidrs"]),
            allow_domains=None if data.get("allow_domains") is None else list(data["allow_domains"]),
            max_connections=data.get("max_connections"),
        )


@dataclasses.dataclass
class NetworkStatus(Model):
    """`NetworkStatus` in docs/openapi.json."""

    #: Whether the sandbox has a network (the server runs with networking).
    enabled: bool
    policy: Optional[NetworkPolicy] = None
    traffic: Optional[TrafficCounters] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NetworkStatus:
        return cls(
            enabled=data["enabled"],
            policy=None if data.get("policy") is None else NetworkPolicy.from_json(data["policy"]),
            traffic=None if data.get("traffic") is None else TrafficCounters.from_json(data["traffic"]),
        )


@dataclasses.dataclass
class PatchBody(Model):
    """`PatchBody` in docs/openapi.json."""

    #: The new size, at least the current one: volumes grow, never shrink.
    size_mb: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchBody:
        return cls(
            size_mb=data.get("size_mb"),
        )


@dataclasses.dataclass
class PatchDatabaseBody(Model):
    """`PatchDatabaseBody` in docs/openapi.json."""

    always_on: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchDatabaseBody:
        return cls(
            always_on=data.get("always_on"),
        )


@dataclasses.dataclass
class PatchFunctionBody(Model):
    """`PatchFunctionBody` in docs/openapi.json."""

    name: Optional[str] = None
    #: Replaces the whole environment.
    env: Optional[Dict[str, str]] = None
    public: Optional[bool] = None
    #: Another file of its code (deploys it again).
    entrypoint: Optional[str] = None
    #: Another template (deploys it again).
    template: Optional[str] = None
    timeout_seconds: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchFunctionBody:
        return cls(
            name=data.get("name"),
            env=None if data.get("env") is None else dict(data["env"]),
            public=data.get("public"),
            entrypoint=data.get("entrypoint"),
            template=data.get("template"),
            timeout_seconds=data.get("timeout_seconds"),
        )


@dataclasses.dataclass
class PatchScheduleBody(Model):
    """`PatchScheduleBody` in docs/openapi.json."""

    name: Optional[str] = None
    cron: Optional[str] = None
    timezone: Optional[str] = None
    #: A pause stops its runs; a resume sets its next run from now.
    paused: Optional[bool] = None
    #: `null` removes it.
    input: Optional[Dict[str, Any]] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchScheduleBody:
        return cls(
            name=data.get("name"),
            cron=data.get("cron"),
            timezone=data.get("timezone"),
            paused=data.get("paused"),
            input=None if data.get("input") is None else dict(data["input"]),
        )


@dataclasses.dataclass
class PortInfo(Model):
    """A port of a sandbox (§3.10)."""

    port: int
    #: Whether something listens on it now.
    listening: bool
    #: `user` (added with a label) or `detected` (found listening).
    source: str
    #: The authenticated proxy: `/v1/sandboxes/{id}/proxy/{port}/`.
    proxy_url: str
    #: The preview host: `http://{port}-{id}.{suffix}` (public unless the sandbox has `preview_auth`).
    preview_url: str
    label: Optional[str] = None
    #: The address it listens on (`0.0.0.0`, `127.0.0.1`, `::`…).
    address: Optional[str] = None
    #: The listening process's name.
    process: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PortInfo:
        return cls(
            port=data["port"],
            listening=data["listening"],
            source=data["source"],
            proxy_url=data["proxy_url"],
            preview_url=data["preview_url"],
            label=data.get("label"),
            address=data.get("address"),
            process=data.get("process"),
        )


@dataclasses.dataclass
class PreviewToken(Model):
    """A signed preview token."""

    #: Accepted as `?clade_token=`, a `clade_token` cookie or an `X-Clade-Preview-Token` header.
    token: str
    #: RFC 3339.
    expires_at: str
    #: The port it opens; every port when absent.
    port: Optional[int] = None
    #: The preview URL with the token, for a token of one port.
    url: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PreviewToken:
        return cls(
            token=data["token"],
            expires_at=data["expires_at"],
            port=data.get("port"),
            url=data.get("url"),
        )


@dataclasses.dataclass
class PreviewTokenBody(Model):
    """What a token opens, and for how long."""

    #: The one port the token opens; every port when absent.
    port: Optional[int] = None
    #: Seconds until it expires (3600 by default, 30 days at most). Also accepted as `ttl`.
    ttl_seconds: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PreviewTokenBody:
        return cls(
            port=data.get("port"),
            ttl_seconds=data.get("ttl_seconds"),
        )


@dataclasses.dataclass
class PromoteBody(Model):
    """`PromoteBody` in docs/openapi.json."""

    #: Delete the winner's siblings.
    cleanup_siblings: Optional[bool] = None
    #: The tree; inferred from the winner when absent.
    tree_id: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PromoteBody:
        return cls(
            cleanup_siblings=data.get("cleanup_siblings"),
            tree_id=data.get("tree_id"),
        )


@dataclasses.dataclass
class PromoteResult(Model):
    """The answer of a promote."""

    winner: str
    tree_id: str
    #: The siblings deleted (`cleanup_siblings`).
    deleted: List[str]
    #: Siblings that could not be deleted, with the reason.
    failures: Dict[str, str]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PromoteResult:
        return cls(
            winner=data["winner"],
            tree_id=data["tree_id"],
            deleted=list(data["deleted"]),
            failures=dict(data["failures"]),
        )


@dataclasses.dataclass
class QueryRequest(Model):
    """One SQL statement and its parameters (`$1`, `$2`, …)."""

    sql: str
    #: In order: `params[0]` is `$1`. `null` is NULL; strings, numbers and booleans go as their text,
    #: arrays and objects as JSON text, and PostgreSQL reads each as the type it inferred for its
    #: placeholder.
    params: Optional[List[Any]] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QueryRequest:
        return cls(
            sql=data["sql"],
            params=None if data.get("params") is None else list(data["params"]),
        )


@dataclasses.dataclass
class QueryResult(Model):
    """What a statement answered."""

    #: Empty for a statement that returns no rows (DDL, INSERT without RETURNING).
    columns: List[Column]
    #: One array per row, in the order of `columns`. Numbers and booleans are JSON's; numeric, bytea (`\x…`
    #: hex), uuid and the date and time types (ISO 8601; timestamptz in UTC with `Z`) are strings; json and
    #: jsonb are JSON.
    rows: List[List[Any]]
    #: Rows returned or affected, as the command tag counts them.
    row_count: int
    #: PostgreSQL's command tag: `SELECT 2`, `INSERT 0 1`, `CREATE TABLE`.
    command: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QueryResult:
        return cls(
            columns=[Column.from_json(item) for item in data["columns"]],
            rows=[list(item) for item in data["rows"]],
            row_count=data["row_count"],
            command=data["command"],
        )


@dataclasses.dataclass
class RecordRunBody(Model):
    """`RecordRunBody` in docs/openapi.json."""

    #: `success`, `error`, `timeout` or `running`.
    status: str
    sandbox_id: Optional[str] = None
    exit_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None
    duration_ms: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RecordRunBody:
        return cls(
            status=data["status"],
            sandbox_id=data.get("sandbox_id"),
            exit_code=data.get("exit_code"),
            stdout=data.get("stdout"),
            stderr=data.get("stderr"),
            duration_ms=data.get("duration_ms"),
        )


@dataclasses.dataclass
class RunCodeBody(Model):
    """`RunCodeBody` in docs/openapi.json."""

    #: The cell. Required, not blank.
    code: str
    #: Interrupt the cell after this long (default 30000); the context keeps its state.
    timeout_ms: Optional[int] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunCodeBody:
        return cls(
            code=data["code"],
            timeout_ms=data.get("timeout_ms"),
        )


@dataclasses.dataclass
class Sandbox(Model):
    """A sandbox (§3.2)."""

    id: str
    template: str
    cpu: int
    memory_mb: int
    #: `creating`, `running`, `paused`, `hibernated`, `failed`, `lost` (its host stopped answering while it
    #: ran; see `state_reason`) or `deleted`.
    status: str
    #: RFC 3339.
    created_at: str
    #: Without the write-only `secret.` keys.
    metadata: Dict[str, str]
    persistent: bool
    #: Idle time after which a non-persistent sandbox is deleted (0: never).
    ttl_seconds: int
    #: Its preview hosts need a token (`POST /v1/sandboxes/{id}/preview-token`); otherwise they are public.
    preview_auth: bool
    from_snapshot: Optional[str] = None
    #: Why the sandbox is `failed`.
    error: Optional[str] = None
    #: How long the boot took (answers of create and fork only).
    boot_ms: Optional[int] = None
    #: `cold`, `standby`, `template` or `snapshot` (answers of create and fork only).
    boot_mode: Optional[str] = None
    disk: Optional[SandboxDisk] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sandbox:
        return cls(
            id=data["id"],
            template=data["template"],
            cpu=data["cpu"],
            memory_mb=data["memory_mb"],
            status=data["status"],
            created_at=data["created_at"],
            metadata=dict(data["metadata"]),
            persistent=data["persistent"],
            ttl_seconds=data["ttl_seconds"],
            preview_auth=data["preview_auth"],
            from_snapshot=data.get("from_snapshot"),
            error=data.get("error"),
            boot_ms=data.get("boot_ms"),
            boot_mode=data.get("boot_mode"),
            disk=None if data.get("disk") is None else SandboxDisk.from_json(data["disk"]),
        )


@dataclasses.dataclass
class SandboxDisk(Model):
    """A sandbox's disk."""

    #: What the guest sees.
    size_bytes: int
    #: What its own writes take on the host (files it deleted give theirs back).
    used_bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SandboxDisk:
        return cls(
            size_bytes=data["size_bytes"],
            used_bytes=data["used_bytes"],
        )


@dataclasses.dataclass
class SandboxPatch(Model):
    """The settings of a sandbox that can change; at least one field."""

    #: Whether its preview hosts need a signed token.
    preview_auth: Optional[bool] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SandboxPatch:
        return cls(
            preview_auth=data.get("preview_auth"),
        )


@dataclasses.dataclass
class ScheduleInfo(Model):
    """A cron schedule of a function (PandaStack's ScheduleInfo)."""

    id: str
    #: The workspace's name.
    workspace: str
    name: str
    function_id: str
    #: Five fields (minute hour day-of-month month day-of-week) or a macro such as `@hourly`.
    cron: str
    #: The IANA time zone its expression is read in.
    timezone: str
    paused: bool
    created_at: str
    updated_at: str
    #: The input its runs get.
    input: Any = None
    #: RFC 3339.
    last_run_at: Optional[str] = None
    #: RFC 3339; absent while paused.
    next_run_at: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScheduleInfo:
        return cls(
            id=data["id"],
            workspace=data["workspace"],
            name=data["name"],
            function_id=data["function_id"],
            cron=data["cron"],
            timezone=data["timezone"],
            paused=data["paused"],
            created_at=data["created_at"],
            updated_at=data["updated_at"],
            input=data.get("input"),
            last_run_at=data.get("last_run_at"),
            next_run_at=data.get("next_run_at"),
        )


@dataclasses.dataclass
class ScheduleList(Model):
    """`ScheduleList` in docs/openapi.json."""

    items: List[ScheduleInfo]
    count: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScheduleList:
        return cls(
            items=[ScheduleInfo.from_json(item) for item in data["items"]],
            count=data["count"],
        )


@dataclasses.dataclass
class SetEnvBody(Model):
    """`SetEnvBody` in docs/openapi.json."""

    #: Required.
    value: Optional[str] = None
    secret: Optional[bool] = None
    #: Default `all`.
    scope: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SetEnvBody:
        return cls(
            value=data.get("value"),
            secret=data.get("secret"),
            scope=data.get("scope"),
        )


@dataclasses.dataclass
class Snapshot(Model):
    """A snapshot of a sandbox (§3.8)."""

    id: str
    #: The same as `id`.
    snapshot_id: str
    sandbox_id: str
    template: str
    size_bytes: int
    #: RFC 3339.
    created_at: str
    #: The workspace's name.
    workspace: str
    #: Its name, unique in the workspace, if it was given one: it names the snapshot wherever its id does
    #: (`from_snapshot`, get, delete).
    name: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        return cls(
            id=data["id"],
            snapshot_id=data["snapshot_id"],
            sandbox_id=data["sandbox_id"],
            template=data["template"],
            size_bytes=data["size_bytes"],
            created_at=data["created_at"],
            workspace=data["workspace"],
            name=data.get("name"),
        )


@dataclasses.dataclass
class Snapshots(Model):
    """`Snapshots` in docs/openapi.json."""

    snapshots: List[Snapshot]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshots:
        return cls(
            snapshots=[Snapshot.from_json(item) for item in data["snapshots"]],
        )


@dataclasses.dataclass
class SseEvent(Model):
    """One event as the OpenAPI document describes a `text/event-stream`
    answer (a schema only: [`event`] writes them).
    """

    #: `stdout`, `stderr`, then `exit` or `error` (exec/stream); `line` (logs); `event` (events).
    event: str
    #: One line of JSON: `{"chunk": "…"}`, `{"exit_code": N}`, `{"error": "…"}`, `{"line": "…"}`, an
    #: `Event`.
    data: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SseEvent:
        return cls(
            event=data["event"],
            data=data["data"],
        )


@dataclasses.dataclass
class Template(Model):
    """A template a sandbox can be created from (§3.11)."""

    name: str
    #: vCPUs and memory of its sandboxes.
    cpu: int
    memory_mb: int
    #: The root filesystem's apparent size when built on this host, else 0.
    size_bytes: int
    #: First-party, visible to every workspace (and not deletable).
    is_global: bool
    #: Built and cached on this host: a create from it does not wait for a build.
    ready: bool
    label: str
    description: str
    category: str
    #: What a sandbox of it finds on PATH beyond a shell's basics.
    tools: List[str]
    #: `{"alias_of": NAME}` for an alias (the operator's `--template-alias`); for a workspace's own
    #: template, what its build recorded (`build_id`, `env`, `workdir`, `user`, `ports`, `start_command`,
    #: `labels`).
    meta: Dict[str, Any]
    #: The template it is built on; for an alias, the one it resolves to.
    base: Optional[str] = None
    #: The workspace a template of its own belongs to.
    workspace: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Template:
        return cls(
            name=data["name"],
            cpu=data["cpu"],
            memory_mb=data["memory_mb"],
            size_bytes=data["size_bytes"],
            is_global=data["is_global"],
            ready=data["ready"],
            label=data["label"],
            description=data["description"],
            category=data["category"],
            tools=list(data["tools"]),
            meta=dict(data["meta"]),
            base=data.get("base"),
            workspace=data.get("workspace"),
        )


@dataclasses.dataclass
class TemplateBuild(Model):
    """A template build (§3.11)."""

    id: str
    #: The template it makes.
    name: str
    #: `queued`, `running`, then `done` or `failed`.
    status: str
    #: RFC 3339.
    started_at: str
    size_mb: int
    cpu: int
    memory_mb: int
    #: `rootfs` (a root filesystem or an image archive), `image` (an OCI reference pulled) or `dockerfile`.
    mode: str
    owner_workspace: str
    error: Optional[str] = None
    ended_at: Optional[str] = None
    #: The finished image's size.
    bytes: Optional[int] = None
    image_ref: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TemplateBuild:
        return cls(
            id=data["id"],
            name=data["name"],
            status=data["status"],
            started_at=data["started_at"],
            size_mb=data["size_mb"],
            cpu=data["cpu"],
            memory_mb=data["memory_mb"],
            mode=data["mode"],
            owner_workspace=data["owner_workspace"],
            error=data.get("error"),
            ended_at=data.get("ended_at"),
            bytes=data.get("bytes"),
            image_ref=data.get("image_ref"),
        )


@dataclasses.dataclass
class Token(Model):
    """An API key of the workspace, without its secret (§3.17)."""

    id: str
    #: `clade_` and the key's first hex digits; what `DELETE` takes.
    prefix: str
    label: str
    #: The same as `label`.
    name: str
    #: RFC 3339.
    created_at: str
    #: RFC 3339, or null if never used. Recorded at most once a minute.
    last_used_at: Optional[str] = None
    #: RFC 3339: when the key stops working (401 after); null for a key valid until revoked.
    expires_at: Optional[str] = None
    #: The secret: only in the answer of the create.
    token: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Token:
        return cls(
            id=data["id"],
            prefix=data["prefix"],
            label=data["label"],
            name=data["name"],
            created_at=data["created_at"],
            last_used_at=data.get("last_used_at"),
            expires_at=data.get("expires_at"),
            token=data.get("token"),
        )


@dataclasses.dataclass
class Tokens(Model):
    """`Tokens` in docs/openapi.json."""

    items: List[Token]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Tokens:
        return cls(
            items=[Token.from_json(item) for item in data["items"]],
        )


@dataclasses.dataclass
class TrafficCounters(Model):
    """Bytes and packets through the sandbox's interface since its network
    was set up (a wake starts them again).
    """

    tx_bytes: int
    tx_packets: int
    rx_bytes: int
    rx_packets: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrafficCounters:
        return cls(
            tx_bytes=data["tx_bytes"],
            tx_packets=data["tx_packets"],
            rx_bytes=data["rx_bytes"],
            rx_packets=data["rx_packets"],
        )


@dataclasses.dataclass
class Truncated(Model):
    """`Truncated` in docs/openapi.json."""

    limit_bytes: int
    stdout_dropped: int
    stderr_dropped: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Truncated:
        return cls(
            limit_bytes=data["limit_bytes"],
            stdout_dropped=data["stdout_dropped"],
            stderr_dropped=data["stderr_dropped"],
        )


@dataclasses.dataclass
class Version(Model):
    """`Version` in docs/openapi.json."""

    #: `clade`.
    name: str
    version: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Version:
        return cls(
            name=data["name"],
            version=data["version"],
        )


@dataclasses.dataclass
class Volume(Model):
    """A named disk that outlives sandboxes (§3.12)."""

    name: str
    #: What the guest's filesystem sees.
    size_mb: int
    size_bytes: int
    #: RFC 3339.
    created_at: str
    attachments: List[Attachment]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Volume:
        return cls(
            name=data["name"],
            size_mb=data["size_mb"],
            size_bytes=data["size_bytes"],
            created_at=data["created_at"],
            attachments=[Attachment.from_json(item) for item in data["attachments"]],
        )


@dataclasses.dataclass
class VolumeAttachment(Model):
    """A volume in a sandbox create's `volumes`."""

    name: str
    #: Attached read-only: the guest's kernel refuses writes (default false).
    read_only: Optional[bool] = None
    #: An absolute path the guest mounts it at before the sandbox is handed over; without one, the disk is
    #: there to mount (`mount /dev/vdb /mnt`).
    mount_path: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VolumeAttachment:
        return cls(
            name=data["name"],
            read_only=data.get("read_only"),
            mount_path=data.get("mount_path"),
        )


@dataclasses.dataclass
class WakeStatus(Model):
    """`WakeStatus` in docs/openapi.json."""

    id: str
    status: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WakeStatus:
        return cls(
            id=data["id"],
            status=data["status"],
        )


@dataclasses.dataclass
class WorkspaceRef(Model):
    """`WorkspaceRef` in docs/openapi.json."""

    id: str
    name: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkspaceRef:
        return cls(
            id=data["id"],
            name=data["name"],
        )


@dataclasses.dataclass
class Written(Model):
    """`Written` in docs/openapi.json."""

    path: str
    bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Written:
        return cls(
            path=data["path"],
            bytes=data["bytes"],
        )


MODELS = {
    "AddPort": AddPort,
    "AppBody": AppBody,
    "AppEnvImported": AppEnvImported,
    "AppEnvList": AppEnvList,
    "AppEnvSet": AppEnvSet,
    "AppEnvVar": AppEnvVar,
    "AppInfo": AppInfo,
    "AppList": AppList,
    "Attachment": Attachment,
    "ChildError": ChildError,
    "CloneBody": CloneBody,
    "CodeContext": CodeContext,
    "Column": Column,
    "ConnectionInfo": ConnectionInfo,
    "CreateContextBody": CreateContextBody,
    "CreateDatabaseBody": CreateDatabaseBody,
    "CreateFunctionBody": CreateFunctionBody,
    "CreateSandboxBody": CreateSandboxBody,
    "CreateScheduleBody": CreateScheduleBody,
    "CreateSnapshotBody": CreateSnapshotBody,
    "CreateToken": CreateToken,
    "CreateVolumeBody": CreateVolumeBody,
    "Credentials": Credentials,
    "DatabaseInfo": DatabaseInfo,
    "DatabaseList": DatabaseList,
    "DatabaseLogs": DatabaseLogs,
    "DeployBody": DeployBody,
    "DeployForm": DeployForm,
    "DeploymentInfo": DeploymentInfo,
    "DeploymentList": DeploymentList,
    "DirListing": DirListing,
    "ErrorBody": ErrorBody,
    "Event": Event,
    "Events": Events,
    "ExecBody": ExecBody,
    "ExecResult": ExecResult,
    "Execution": Execution,
    "FileEntry": FileEntry,
    "ForkBody": ForkBody,
    "ForkResult": ForkResult,
    "ForkTreeResult": ForkTreeResult,
    "FunctionInfo": FunctionInfo,
    "FunctionList": FunctionList,
    "FunctionRun": FunctionRun,
    "FunctionRunList": FunctionRunList,
    "Health": Health,
    "HibernateBody": HibernateBody,
    "ImportEnvBody": ImportEnvBody,
    "InvokeBody": InvokeBody,
    "KeyRef": KeyRef,
    "LifecyclePatch": LifecyclePatch,
    "LifecycleSettings": LifecycleSettings,
    "LifecycleStatus": LifecycleStatus,
    "Limits": Limits,
    "Me": Me,
    "Metrics": Metrics,
    "NetworkPolicy": NetworkPolicy,
    "NetworkStatus": NetworkStatus,
    "PatchBody": PatchBody,
    "PatchDatabaseBody": PatchDatabaseBody,
    "PatchFunctionBody": PatchFunctionBody,
    "PatchScheduleBody": PatchScheduleBody,
    "PortInfo": PortInfo,
    "PreviewToken": PreviewToken,
    "PreviewTokenBody": PreviewTokenBody,
    "PromoteBody": PromoteBody,
    "PromoteResult": PromoteResult,
    "QueryRequest": QueryRequest,
    "QueryResult": QueryResult,
    "RecordRunBody": RecordRunBody,
    "RunCodeBody": RunCodeBody,
    "Sandbox": Sandbox,
    "SandboxDisk": SandboxDisk,
    "SandboxPatch": SandboxPatch,
    "ScheduleInfo": ScheduleInfo,
    "ScheduleList": ScheduleList,
    "SetEnvBody": SetEnvBody,
    "Snapshot": Snapshot,
    "Snapshots": Snapshots,
    "SseEvent": SseEvent,
    "Template": Template,
    "TemplateBuild": TemplateBuild,
    "Token": Token,
    "Tokens": Tokens,
    "TrafficCounters": TrafficCounters,
    "Truncated": Truncated,
    "Version": Version,
    "Volume": Volume,
    "VolumeAttachment": VolumeAttachment,
    "WakeStatus": WakeStatus,
    "WorkspaceRef": WorkspaceRef,
    "Written": Written,
}
