"""The client (`AsyncClade`) and the objects it hands out: sandboxes, their
files, code contexts, and the workspace's resources. Requests are built by
`_api` and sent by the transport; this module strings them together.

This is the async client. `_sync.py` (`Clade`) is generated from it by
scripts/generate_sync.py, which drops `async`/`await` and the `Async` of
names: write code here that reads right both ways. A wait that is not a
request goes through `_async_io` (`_sync_io` in the sync client)."""

from __future__ import annotations

import base64
import os
import time
from types import TracebackType
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence, Type, Union

import httpx

from . import _api as api
from . import _generated as gen
from ._async_io import INTERRUPTIONS, run_blocking, run_shielded, sleep
from ._async_transport import AsyncTransport, async_sse_events
from ._bundles import BundleSource, function_bundle
from ._errors import (
    AppDeployError,
    AppDeployTimeoutError,
    CommandFailedError,
    ConflictError,
    DatabaseFailedError,
    DatabaseTimeoutError,
    FunctionDeployError,
    FunctionDeployTimeoutError,
    NotFoundError,
    StreamError,
)
from ._models import CodeEvent, DatabaseStats, Execution, ExecEvent, Exit, ForkTree, code_event, exec_event
from ._retry import DEFAULT_MAX_RETRIES, RetryPolicy
from ._settings import resolve_settings
from ._streams import AsyncEvents, AsyncStream, event_json
from ._transport import DEFAULT_TIMEOUT
from ._uploads import CHUNK_SIZE, AsyncUploadSource, async_upload_body

Destination = Union[str, "os.PathLike[str]", IO[bytes]]

#: Seconds a create or clone waits for its database by default (the first
#: database of a size bakes its template: tens of seconds under TCG).
DATABASE_WAIT_TIMEOUT = 300.0
#: Seconds a function's create or deploy waits for the deploy by default: a
#: sandbox booted, the dependencies installed, a snapshot taken (and, the
#: first time a template is used on a host, its image made).
FUNCTION_WAIT_TIMEOUT = 600.0
#: Seconds an app's deploy waits for its deployment by default: a fetch, an
#: install and a build (each may take minutes under emulation), a sandbox
#: made and the app started.
APP_DEPLOY_WAIT_TIMEOUT = 1800.0
#: Polling a database, a function or a deployment being made: the first look soon, then less often.
POLL_FIRST = 0.25
POLL_MAX = 2.0


class AsyncClade:
    """A client of a Clade server.

    Settings come from the arguments, then `CLADE_API_URL` / `CLADE_API_KEY`,
    then `~/.config/clade/config.json`. `timeout` (seconds) and
    `max_retries` apply to every request but the long ones (a create, which
    may bake its template first: 10 minutes; an invoke: 16; a deployment's
    log: 30; a command or a cell: its own timeout and a margin);
    `with_options` changes them for some calls."""

    def __init__(
        self,
        api_key: Optional[str] = None,
        api_url: Optional[str] = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: Optional[httpx.AsyncClient] = None,
        _transport: Optional[AsyncTransport] = None,
    ) -> None:
        self._transport = _transport or AsyncTransport(
            resolve_settings(api_url, api_key), timeout=timeout, retry=RetryPolicy(max_retries=max_retries), http=http_client
        )
        self.sandboxes = AsyncSandboxes(self._transport)
        self.templates = AsyncTemplates(self._transport)
        self.builds = AsyncBuilds(self._transport)
        self.volumes = AsyncVolumes(self._transport)
        self.snapshots = AsyncSnapshots(self._transport)
        self.keys = AsyncKeys(self._transport)
        self.databases = AsyncDatabases(self._transport)
        self.functions = AsyncFunctions(self._transport)
        self.schedules = AsyncSchedules(self._transport)
        self.apps = AsyncApps(self._transport)

    @property
    def base_url(self) -> str:
        return self._transport.settings.base_url

    def with_options(self, *, timeout: Optional[float] = None, max_retries: Optional[int] = None) -> AsyncClade:
        """The same client (and connections) with another timeout or retry budget."""
        return AsyncClade(_transport=self._transport.with_options(timeout=timeout, max_retries=max_retries))

    async def me(self) -> gen.Me:
        """The caller: its key and workspace."""
        return await self._transport.request(api.me())

    async def health(self) -> gen.Health:
        return await self._transport.request(api.health())

    async def version(self) -> gen.Version:
        return await self._transport.request(api.version())

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClade:
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        await self.close()


class AsyncSandboxes:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(
        self,
        template: Optional[str] = None,
        *,
        metadata: Optional[Mapping[str, str]] = None,
        ttl_seconds: Optional[int] = None,
        persistent: Optional[bool] = None,
        hibernate_after_seconds: Optional[int] = None,
        hibernate_memory: Optional[bool] = None,
        from_snapshot: Optional[str] = None,
        network: Optional[gen.NetworkPolicy] = None,
        volumes: Optional[Sequence[Union[gen.VolumeAttachment, str]]] = None,
        preview_auth: Optional[bool] = None,
        limits: Optional[gen.Limits] = None,
        env: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
    ) -> AsyncSandbox:
        """A new sandbox (from `template`, `base` by default, or `from_snapshot`).
        Retried safely: the request carries an Idempotency-Key."""
        attachments = None if volumes is None else [gen.VolumeAttachment(name=v) if isinstance(v, str) else v for v in volumes]
        body = gen.CreateSandboxBody(
            template=template, metadata=dict(metadata) if metadata is not None else None, ttl_seconds=ttl_seconds,
            persistent=persistent, hibernate_after_seconds=hibernate_after_seconds, hibernate_memory=hibernate_memory,
            from_snapshot=from_snapshot,
            network=network, volumes=attachments,
            preview_auth=preview_auth, limits=limits, env=dict(env) if env is not None else None,
        )
        return AsyncSandbox(self._transport, await self._transport.request(api.create_sandbox(body, idempotency_key)))

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._transport, await self._transport.request(api.get_sandbox(sandbox_id)))

    async def list(self) -> List[AsyncSandbox]:
        return [AsyncSandbox(self._transport, info) for info in await self._transport.request(api.list_sandboxes())]

    async def delete(self, sandbox_id: str) -> None:
        await self._transport.request(api.delete_sandbox(sandbox_id))


class AsyncSandbox:
    """A sandbox: a microVM to run commands and code in, with its files.

    `async with sandbox:` deletes it at the end of the block (also after an
    error) unless it was created persistent."""

    def __init__(self, transport: AsyncTransport, info: gen.Sandbox) -> None:
        self._transport = transport
        #: What the server last said about the sandbox (`refresh()` asks again).
        self.info = info
        self.files = AsyncFiles(transport, info.id)
        self.ports = AsyncPorts(transport, info.id)
        self.network = AsyncNetwork(transport, info.id)
        self.limits = AsyncLimits(transport, info.id)
        self._default_contexts: Dict[str, AsyncCodeContext] = {}

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> str:
        return self.info.status

    @property
    def metadata(self) -> Dict[str, str]:
        return self.info.metadata

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, template={self.info.template!r}, status={self.status!r})"

    def with_options(self, *, timeout: Optional[float] = None, max_retries: Optional[int] = None) -> AsyncSandbox:
        return AsyncSandbox(self._transport.with_options(timeout=timeout, max_retries=max_retries), self.info)

    async def refresh(self) -> gen.Sandbox:
        self.info = await self._transport.request(api.get_sandbox(self.id))
        return self.info

    async def update(self, *, preview_auth: Optional[bool] = None) -> gen.Sandbox:
        self.info = await self._transport.request(api.update_sandbox(self.id, preview_auth))
        return self.info

    async def delete(self) -> None:
        await self._transport.request(api.delete_sandbox(self.id))

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if not self.info.persistent:
            try:
                # (Async: shielded, so that a cancelled task still deletes its sandbox.)
                await run_shielded(self.delete)
            except NotFoundError:
                pass  # already gone (deleted in the block, or a promote's loser): what the block wanted

    # Commands -------------------------------------------------------------

    async def exec(
        self,
        cmd: str,
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        check: bool = False,
        request_timeout: Optional[float] = None,
    ) -> gen.ExecResult:
        """Runs `sh -c cmd` as root and waits for it. `env` is added to the
        sandbox's environment as given (not shell-expanded); `cwd` is an
        absolute directory. `timeout`: seconds the command may run (the
        server kills it after, a 504); `request_timeout`: seconds to wait for
        the answer (the command's timeout and a margin by default) — past it
        the connection is closed and the command killed. `check=True` raises
        `CommandFailedError` on a non-zero exit."""
        seconds, http_timeout = api.exec_timeouts(timeout, request_timeout)
        result = await self._transport.request(api.exec_command(self.id, api.exec_body(cmd, seconds, env, cwd), http_timeout))
        if check and result.exit_code != 0:
            raise CommandFailedError(cmd, result.exit_code, result.stdout, result.stderr)
        return result

    def exec_stream(
        self,
        cmd: str,
        *,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> AsyncStream[ExecEvent]:
        """Runs `sh -c cmd`, yielding `Stdout` / `Stderr` chunks as they come,
        then `Exit`. Leaving the loop early (or `aclose()`) kills the command."""
        seconds, _ = api.exec_timeouts(timeout, None)
        call = api.exec_stream(self.id, api.exec_body(cmd, seconds, env, cwd), request_timeout)

        async def events() -> AsyncEvents[ExecEvent]:
            async with self._transport.stream(call) as response:
                yield None
                async for sse in async_sse_events(response):
                    event = exec_event(sse.event, event_json(sse))
                    if event is not None:
                        yield event
                    if isinstance(event, Exit):
                        return
            raise StreamError("the command's stream ended before its exit code")

        return AsyncStream(events())

    # Code -----------------------------------------------------------------

    async def create_code_context(self, language: str = "python", *, cwd: Optional[str] = None) -> AsyncCodeContext:
        """A persistent interpreter (`python`, `javascript`, `typescript`, `bash`)."""
        return AsyncCodeContext(self._transport, self.id, await self._transport.request(api.create_code_context(self.id, language, cwd)))

    async def list_code_contexts(self) -> List[AsyncCodeContext]:
        return [AsyncCodeContext(self._transport, self.id, info) for info in await self._transport.request(api.list_code_contexts(self.id))]

    async def _context(self, language: str, context: Optional[AsyncCodeContext]) -> AsyncCodeContext:
        if context is not None:
            return context
        if language not in self._default_contexts:
            self._default_contexts[language] = await self.create_code_context(language)
        return self._default_contexts[language]

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        context: Optional[AsyncCodeContext] = None,
        timeout: Optional[float] = None,
        request_timeout: Optional[float] = None,
    ) -> Execution:
        """Runs a cell in `context`, or in this sandbox's default context of
        `language` (made on first use, so state carries from cell to cell)."""
        return await (await self._context(language, context)).run(code, timeout=timeout, request_timeout=request_timeout)

    def run_code_stream(
        self,
        code: str,
        *,
        language: str = "python",
        context: Optional[AsyncCodeContext] = None,
        timeout: Optional[float] = None,
        request_timeout: Optional[float] = None,
    ) -> AsyncStream[CodeEvent]:
        async def events() -> AsyncEvents[CodeEvent]:
            stream = (await self._context(language, context)).run_stream(code, timeout=timeout, request_timeout=request_timeout)
            async with stream:
                yield None
                async for event in stream:
                    yield event

        return AsyncStream(events())

    # Lifecycle ------------------------------------------------------------

    async def pause(self) -> None:
        await self._transport.request(api.pause(self.id))

    async def resume(self) -> None:
        await self._transport.request(api.resume(self.id))

    async def hibernate(self, *, memory: bool = True) -> str:
        """Saves the sandbox and stops its VM; the next use wakes it. With
        `memory=False` only the disk is kept: the wake boots it, and what ran
        is gone (its files, variables, network and volumes stay)."""
        return await self._transport.request(api.hibernate(self.id, memory))

    async def wake(self) -> str:
        return await self._transport.request(api.wake(self.id))

    async def stop(self) -> str:
        return await self._transport.request(api.stop(self.id))

    async def start(self) -> str:
        return await self._transport.request(api.start(self.id))

    async def get_lifecycle(self) -> gen.LifecycleSettings:
        return await self._transport.request(api.get_lifecycle(self.id))

    async def set_lifecycle(
        self,
        *,
        ttl_seconds: Optional[int] = None,
        persistent: Optional[bool] = None,
        hibernate_after_seconds: Optional[int] = None,
        hibernate_memory: Optional[bool] = None,
    ) -> gen.LifecycleSettings:
        settings = await self._transport.request(
            api.patch_lifecycle(self.id, ttl_seconds, persistent, hibernate_after_seconds, hibernate_memory))
        self.info.persistent, self.info.ttl_seconds = settings.persistent, settings.ttl_seconds
        return settings

    # Forks and snapshots --------------------------------------------------

    async def fork(self, count: int = 1, *, metadata: Optional[Mapping[str, str]] = None, idempotency_key: Optional[str] = None) -> List[AsyncSandbox]:
        """`count` children (at most 16), each a copy of this sandbox as it is now."""
        result = await self._transport.request(api.fork(self.id, count, metadata, idempotency_key))
        return [AsyncSandbox(self._transport, child) for child in result.children]

    async def fork_tree(
        self, count: int = 2, *, metadata: Optional[Mapping[str, str]] = None, idempotency_key: Optional[str] = None
    ) -> ForkTree[AsyncSandbox]:
        """Children that `promote` can choose a winner among."""
        result = await self._transport.request(api.fork_tree(self.id, count, metadata, idempotency_key))
        children = [AsyncSandbox(self._transport, child) for child in result.children]
        return ForkTree(result.tree_id, result.parent_id, result.at, children, result.errors)

    async def promote(self, *, cleanup_siblings: Optional[bool] = None, tree_id: Optional[str] = None) -> gen.PromoteResult:
        """Makes this child of a fork tree the winner (deleting its siblings with `cleanup_siblings`)."""
        return await self._transport.request(api.promote(self.id, cleanup_siblings, tree_id))

    async def snapshot(self, *, name: Optional[str] = None, idempotency_key: Optional[str] = None) -> gen.Snapshot:
        """Memory, disk and processes; `sandboxes.create(from_snapshot=...)` makes sandboxes from it, by
        its id or its `name` (unique in the workspace)."""
        return await self._transport.request(api.create_snapshot(self.id, idempotency_key, name))

    # Events, logs, previews -----------------------------------------------

    async def events(self, *, tail: Optional[int] = None) -> List[gen.Event]:
        return await self._transport.request(api.list_events(self.id, tail))

    def stream_events(self, *, tail: Optional[int] = None) -> AsyncStream[gen.Event]:
        """The events, then new ones as they happen, until the sandbox is deleted."""
        call = api.follow_events(self.id, tail)

        async def events() -> AsyncEvents[gen.Event]:
            async with self._transport.stream(call) as response:
                yield None
                async for sse in async_sse_events(response):
                    if sse.event == "event":
                        yield gen.Event.from_json(event_json(sse))

        return AsyncStream(events())

    async def logs(self, *, stream: str = "both") -> str:
        """The guest's console (`stdout`), the VMM's errors (`stderr`), or both."""
        return await self._transport.request(api.logs(self.id, stream))

    def stream_logs(self, *, stream: str = "both") -> AsyncStream[str]:
        call = api.follow_logs(self.id, stream)

        async def lines() -> AsyncEvents[str]:
            async with self._transport.stream(call) as response:
                yield None
                async for sse in async_sse_events(response):
                    if sse.event == "line":
                        yield str(event_json(sse).get("line", ""))

        return AsyncStream(lines())

    def preview_url(self, port: int) -> str:
        """The URL of `port` on the preview host, as the server makes it."""
        return api.preview_url(self._transport.settings.base_url, self.id, port)

    async def preview_token(self, port: Optional[int] = None, *, ttl_seconds: Optional[int] = None) -> gen.PreviewToken:
        """A signed token for the preview host of `port` (every port when None)."""
        return await self._transport.request(api.create_preview_token(self.id, port, ttl_seconds))


class AsyncCodeContext:
    """A persistent interpreter in a sandbox: variables live from cell to cell."""

    def __init__(self, transport: AsyncTransport, sandbox_id: str, info: gen.CodeContext) -> None:
        self._transport = transport
        self.sandbox_id = sandbox_id
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def language(self) -> str:
        return self.info.language

    def __repr__(self) -> str:
        return f"AsyncCodeContext(id={self.id!r}, language={self.language!r})"

    async def run(self, code: str, *, timeout: Optional[float] = None, request_timeout: Optional[float] = None) -> Execution:
        millis, http_timeout = api.code_timeouts(timeout, request_timeout)
        return await self._transport.request(api.run_code(self.sandbox_id, self.id, code, millis, http_timeout))

    def run_stream(self, code: str, *, timeout: Optional[float] = None, request_timeout: Optional[float] = None) -> AsyncStream[CodeEvent]:
        """The cell's output and results as they come, then `CellDone`."""
        millis, http_timeout = api.code_timeouts(timeout, request_timeout)
        call = api.run_code_stream(self.sandbox_id, self.id, code, millis, http_timeout)

        async def events() -> AsyncEvents[CodeEvent]:
            async with self._transport.stream(call) as response:
                yield None
                async for sse in async_sse_events(response):
                    event = code_event(sse.event, event_json(sse))
                    if event is not None:
                        yield event

        return AsyncStream(events())

    async def delete(self) -> None:
        await self._transport.request(api.delete_code_context(self.sandbox_id, self.id))


class AsyncFiles:
    """A sandbox's files. Paths are absolute; transfers are streamed both ways."""

    def __init__(self, transport: AsyncTransport, sandbox_id: str) -> None:
        self._transport = transport
        self._sandbox_id = sandbox_id

    async def read(self, path: str, *, request_timeout: Optional[float] = None) -> bytes:
        """The whole file in memory; `iter_chunks` or `download` for big ones."""
        async with self._transport.stream(api.read_file(self._sandbox_id, path, request_timeout)) as response:
            return await response.aread()

    async def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    def iter_chunks(self, path: str, *, chunk_size: int = CHUNK_SIZE, request_timeout: Optional[float] = None) -> AsyncStream[bytes]:
        """The file's bytes as they come."""
        call = api.read_file(self._sandbox_id, path, request_timeout)

        async def chunks() -> AsyncEvents[bytes]:
            async with self._transport.stream(call) as response:
                yield None
                async for chunk in response.aiter_bytes(chunk_size):
                    yield chunk

        return AsyncStream(chunks())

    async def download(self, path: str, destination: Destination, *, request_timeout: Optional[float] = None) -> int:
        """Copies the file to a local path or a binary file object; returns its size."""
        written = 0
        async with self.iter_chunks(path, request_timeout=request_timeout) as chunks:
            if isinstance(destination, (str, os.PathLike)):
                with open(destination, "wb") as file:
                    async for chunk in chunks:
                        written += await run_blocking(file.write, chunk)
            else:
                async for chunk in chunks:
                    written += destination.write(chunk)
        return written

    async def write(self, path: str, data: Union[bytes, str], *, request_timeout: Optional[float] = None) -> gen.Written:
        """Writes the file (parent directories are made); `str` is written as UTF-8."""
        content = data.encode() if isinstance(data, str) else bytes(data)
        return await self._transport.request(api.write_file(self._sandbox_id, path, content, request_timeout))

    async def upload(self, source: AsyncUploadSource, path: str, *, request_timeout: Optional[float] = None) -> gen.Written:
        """Streams a local path, a binary file object, bytes or an iterable
        of bytes into the sandbox's `path`, of any size. A body that can be
        made again (not an iterator) is resent on a retry."""
        body = async_upload_body(source)
        call = api.write_file(self._sandbox_id, path, None, request_timeout)
        call.headers.update(body.headers)
        return await self._transport.request(call, body=body.make, replayable=body.replayable)

    async def list(self, path: str) -> List[gen.FileEntry]:
        return await self._transport.request(api.list_dir(self._sandbox_id, path))

    async def stat(self, path: str) -> gen.FileEntry:
        return await self._transport.request(api.stat_path(self._sandbox_id, path))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except NotFoundError:
            return False

    async def remove(self, path: str) -> None:
        """`rm -rf`: a missing path is fine."""
        await self._transport.request(api.remove_path(self._sandbox_id, path))


class AsyncPorts:
    def __init__(self, transport: AsyncTransport, sandbox_id: str) -> None:
        self._transport = transport
        self._sandbox_id = sandbox_id

    async def list(self) -> List[gen.PortInfo]:
        """Labelled ports and ports something listens on, with their URLs."""
        return await self._transport.request(api.list_ports(self._sandbox_id))

    async def add(self, port: int, *, label: Optional[str] = None) -> gen.PortInfo:
        return await self._transport.request(api.add_port(self._sandbox_id, port, label))

    async def remove(self, port: int) -> None:
        await self._transport.request(api.remove_port(self._sandbox_id, port))


class AsyncNetwork:
    def __init__(self, transport: AsyncTransport, sandbox_id: str) -> None:
        self._transport = transport
        self._sandbox_id = sandbox_id

    async def get(self) -> gen.NetworkStatus:
        return await self._transport.request(api.get_network(self._sandbox_id))

    async def set(
        self,
        policy: Optional[gen.NetworkPolicy] = None,
        *,
        internet: Optional[bool] = None,
        allow_cidrs: Optional[List[str]] = None,
        deny_cidrs: Optional[List[str]] = None,
        allow_domains: Optional[List[str]] = None,
        max_connections: Optional[int] = None,
    ) -> gen.NetworkStatus:
        """Replaces the egress policy (live); absent fields take their defaults."""
        policy = policy or gen.NetworkPolicy(
            internet=internet, allow_cidrs=allow_cidrs, deny_cidrs=deny_cidrs, allow_domains=allow_domains, max_connections=max_connections
        )
        return await self._transport.request(api.set_network(self._sandbox_id, policy))


class AsyncLimits:
    def __init__(self, transport: AsyncTransport, sandbox_id: str) -> None:
        self._transport = transport
        self._sandbox_id = sandbox_id

    async def get(self) -> gen.Limits:
        return await self._transport.request(api.get_limits(self._sandbox_id))

    async def set(self, *, memory_mb: Optional[int] = None, max_processes: Optional[int] = None) -> gen.Limits:
        """Changes the limits of all its commands together; absent ones stay."""
        return await self._transport.request(api.set_limits(self._sandbox_id, gen.Limits(memory_mb=memory_mb, max_processes=max_processes)))


class AsyncTemplates:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def list(self) -> List[gen.Template]:
        return await self._transport.request(api.list_templates())

    async def get(self, name: str) -> gen.Template:
        return await self._transport.request(api.get_template(name))

    async def delete(self, name: str) -> None:
        await self._transport.request(api.delete_template(name))

    async def build(
        self,
        name: str,
        *,
        dockerfile: Optional[str] = None,
        context: Optional[Mapping[str, bytes]] = None,
        image_ref: Optional[str] = None,
        rootfs: Optional[Union[str, "os.PathLike[str]"]] = None,
        size_mb: Optional[int] = None,
        cpu: Optional[int] = None,
        memory_mb: Optional[int] = None,
        replace: Optional[bool] = None,
    ) -> gen.TemplateBuild:
        """Starts a build from a Dockerfile (and its context's files, by
        relative path), an OCI image reference, or a root filesystem archive.
        `builds.logs(build.id)` follows it; `builds.wait(build.id)` waits."""
        file = open(rootfs, "rb") if rootfs is not None else None
        try:
            call = api.build_template(name, dockerfile=dockerfile, context=context, image_ref=image_ref, rootfs=file,
                                      size_mb=size_mb, cpu=cpu, memory_mb=memory_mb, replace=replace)
            return await self._transport.request(call, replayable=file is None)
        finally:
            if file is not None:
                file.close()


class AsyncBuilds:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def list(self) -> List[gen.TemplateBuild]:
        return await self._transport.request(api.list_builds())

    async def get(self, build_id: str) -> gen.TemplateBuild:
        return await self._transport.request(api.get_build(build_id))

    def logs(self, build_id: str, *, follow: bool = True) -> AsyncStream[str]:
        """The build's log lines; with `follow`, as they come until it ends."""
        call = api.build_logs(build_id, follow)

        async def lines() -> AsyncEvents[str]:
            async with self._transport.stream(call) as response:
                yield None
                async for sse in async_sse_events(response):
                    if sse.event == "done":
                        return
                    yield sse.data

        return AsyncStream(lines())

    async def cancel(self, build_id: str) -> gen.TemplateBuild:
        """Stops a queued or running build (nothing is published): it ends
        `failed`, its error `cancelled by request`. `ConflictError` if it had
        already ended."""
        return await self._transport.request(api.cancel_build(build_id))

    async def wait(
        self, build_id: str, *, timeout: float = 1800.0, poll_interval: float = 1.0, cancel_if_interrupted: bool = True
    ) -> gen.TemplateBuild:
        """The build once it is `done` or `failed` (or as it is after
        `timeout` seconds). Interrupted (Ctrl-C, a cancelled task), the wait
        cancels the build before it gives up, unless `cancel_if_interrupted`
        is False."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                build = await self.get(build_id)
                if build.status in ("done", "failed") or time.monotonic() > deadline:
                    return build
                await sleep(poll_interval)
        except INTERRUPTIONS:
            if cancel_if_interrupted:
                await run_shielded(lambda: self._cancel_if_running(build_id))
            raise

    async def _cancel_if_running(self, build_id: str) -> None:
        try:
            await self.cancel(build_id)
        except (ConflictError, NotFoundError):
            pass  # it ended (or went) meanwhile: nothing to stop


class AsyncVolumes:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(self, name: str, *, size_mb: Optional[int] = None) -> gen.Volume:
        return await self._transport.request(api.create_volume(name, size_mb))

    async def list(self) -> List[gen.Volume]:
        return await self._transport.request(api.list_volumes())

    async def get(self, name: str) -> gen.Volume:
        return await self._transport.request(api.get_volume(name))

    async def resize(self, name: str, size_mb: int) -> gen.Volume:
        """Grows a detached volume and its filesystem."""
        return await self._transport.request(api.resize_volume(name, size_mb))

    async def delete(self, name: str) -> None:
        await self._transport.request(api.delete_volume(name))


class AsyncSnapshots:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def list(self, *, sandbox_id: Optional[str] = None, name: Optional[str] = None) -> List[gen.Snapshot]:
        return await self._transport.request(api.list_snapshots(sandbox_id, name))

    async def get(self, snapshot_id: str) -> gen.Snapshot:
        return await self._transport.request(api.get_snapshot(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        await self._transport.request(api.delete_snapshot(snapshot_id))


class AsyncKeys:
    """The workspace's API keys."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def list(self) -> List[gen.Token]:
        return await self._transport.request(api.list_tokens())

    async def create(
        self, label: Optional[str] = None, *, expires_in_days: Optional[int] = None, format: Optional[str] = None,
    ) -> gen.Token:
        """A new key; its secret (`token`) is shown only in this answer.
        `format="e2b"` spells it as E2B's SDKs expect (`e2b_…`)."""
        return await self._transport.request(api.create_token(label, expires_in_days, format))

    async def revoke(self, prefix: str) -> None:
        await self._transport.request(api.revoke_token(prefix))


class AsyncDatabases:
    """Managed PostgreSQL 15 databases. Each runs in a sandbox of the
    workspace; clients connect with its `connection_url` (TLS, through the
    server's PostgreSQL endpoint), or run statements over HTTP with `query`."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(
        self,
        *,
        size: Optional[str] = None,
        cpu: Optional[int] = None,
        memory_mb: Optional[int] = None,
        label: Optional[str] = None,
        always_on: Optional[bool] = None,
        wait: bool = True,
        timeout: float = DATABASE_WAIT_TIMEOUT,
    ) -> gen.DatabaseInfo:
        """A new database: `size` `1g` (512 MiB of memory and a 4 GiB disk,
        the default), `4g` (1 GiB, 6 GiB) or `16g` (2 GiB, 18 GiB); `cpu`
        (1 to 8) and `memory_mb` (256 to 16384) override the memory. With
        `wait` it is returned running, with its credentials (raises
        `DatabaseFailedError`, or `DatabaseTimeoutError` after `timeout`
        seconds); without, as the server recorded it (`provisioning`).
        Interrupted while waiting (Ctrl-C, a cancelled task), it deletes the
        database it was making."""
        body = gen.CreateDatabaseBody(size=size, cpu=cpu, memory_mb=memory_mb, label=label, always_on=always_on)
        info = await self._transport.request(api.create_database(body))
        return await self._wait_for_new(info, wait, timeout)

    async def wait(self, database_id: str, *, timeout: float = DATABASE_WAIT_TIMEOUT) -> gen.DatabaseInfo:
        """The database once it is ready (running, or hibernated: a connection
        wakes it), with its credentials. Polls with a growing interval;
        `DatabaseFailedError` if it fails, `DatabaseTimeoutError` after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        interval = POLL_FIRST
        while True:
            info = await self.get(database_id)
            if info.status in ("running", "hibernated") and info.connection_url:
                return info
            if info.status == "failed":
                raise DatabaseFailedError(info)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DatabaseTimeoutError(info, timeout)
            await sleep(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX)

    async def _wait_for_new(self, info: gen.DatabaseInfo, wait: bool, timeout: float) -> gen.DatabaseInfo:
        if not wait:
            return info
        try:
            return await self.wait(info.id, timeout=timeout)
        except INTERRUPTIONS:
            # The caller never got its id: a database left behind would be nobody's.
            await run_shielded(lambda: self._delete_if_present(info.id))
            raise

    async def _delete_if_present(self, database_id: str) -> None:
        try:
            await self.delete(database_id)
        except NotFoundError:
            pass

    async def list(self) -> List[gen.DatabaseInfo]:
        """The workspace's databases, oldest first, without credentials."""
        return await self._transport.request(api.list_databases())

    async def get(self, database_id: str) -> gen.DatabaseInfo:
        """A database, with its credentials once it is ready."""
        return await self._transport.request(api.get_database(database_id))

    async def update(self, database_id: str, *, always_on: Optional[bool] = None) -> gen.DatabaseInfo:
        """`always_on=True`: never idled into hibernation."""
        return await self._transport.request(api.update_database(database_id, always_on))

    async def delete(self, database_id: str) -> None:
        """Deletes it with its data and its sandbox."""
        await self._transport.request(api.delete_database(database_id))

    async def connection(self, database_id: str) -> gen.ConnectionInfo:
        """Its `connection_url`, `broker_url` and `broker_token`
        (`ServiceUnavailableError` until it is ready)."""
        return await self._transport.request(api.database_connection(database_id))

    async def reset_credentials(self, database_id: str) -> gen.DatabaseInfo:
        """A new password and broker token; the old ones open nothing, and
        the sessions opened with them are ended."""
        return await self._transport.request(api.reset_database_credentials(database_id))

    async def wake(self, database_id: str) -> str:
        """Restores a hibernated database (a connection would too); its status."""
        return await self._transport.request(api.wake_database(database_id))

    async def clone(
        self,
        database_id: str,
        *,
        label: Optional[str] = None,
        size: Optional[str] = None,
        target_time: Optional[str] = None,
        wait: bool = True,
        timeout: float = DATABASE_WAIT_TIMEOUT,
    ) -> gen.DatabaseInfo:
        """A new database with credentials of its own and the source's data as
        it is now (a copy-on-write fork of its VM), or with `target_time`
        (RFC 3339) as it was then (point-in-time recovery from its archived
        WAL and base backup: `provisioning` until replayed; a time to come or
        before its oldest backup kept is a `BadRequestError`, a source
        without a base backup yet a `ConflictError`). `label` defaults to
        `<label> (clone)`. A clone keeps its
        source's size (another `size` is a `BadRequestError`). `wait` and
        `timeout` as for `create`."""
        info = await self._transport.request(api.clone_database(database_id, label, size, target_time))
        return await self._wait_for_new(info, wait, timeout)

    async def failover(self, database_id: str) -> gen.DatabaseInfo:
        """Rebuilds the database in a new sandbox from its newest base backup
        and the WAL shipped after it: the same id, address and password
        (`sandbox_id` is the new one). Answers when done. A `ConflictError`
        until its first base backup is taken (seconds after it is made;
        `failover_available` says when)."""
        return await self._transport.request(api.failover_database(database_id))

    async def stats(self, database_id: str) -> DatabaseStats:
        return await self._transport.request(api.database_stats(database_id))

    async def logs(self, database_id: str) -> str:
        """The end of its server's log (at most 256 KiB)."""
        return await self._transport.request(api.database_logs(database_id))

    async def query(
        self, database_id: str, sql: str, params: Optional[Sequence[Any]] = None, *, broker_token: Optional[str] = None
    ) -> gen.QueryResult:
        """Runs one statement through the database's HTTP broker, `$1`, `$2`…
        taken from `params` (PostgreSQL reads each as the type it infers
        for its placeholder). The broker is opened by the database's broker
        token, not the API key: `broker_token`, else the one `connection()`
        answers (one request more). A SQL error is a `BadRequestError` with
        its SQLSTATE; a token that is not the database's, an
        `AuthenticationError`. Not retried: the statement may write."""
        token = broker_token or (await self.connection(database_id)).broker_token
        return await self._transport.request(api.database_query(database_id, sql, params, token))



class AsyncFunctions:
    """Functions: code the server keeps and deploys once (a sandbox of its
    template with the dependencies installed, snapshotted); each invoke
    restores that snapshot, runs the entrypoint's `handler(event)` (or the
    module as a script) and records the run."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(
        self,
        name: str,
        runtime: str,
        *,
        code: Optional[Union[bytes, str]] = None,
        entrypoint: Optional[str] = None,
        template: Optional[str] = None,
        public: Optional[bool] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout_seconds: Optional[int] = None,
        wait: bool = True,
        timeout: float = FUNCTION_WAIT_TIMEOUT,
    ) -> gen.FunctionInfo:
        """A new function, `runtime` `python` or `nodejs`. `code` is one
        file's content (it becomes the `entrypoint`, `handler.py` /
        `handler.js` by default), or a tar.gz's bytes, at most 512 KiB;
        without it, `deploy` code later. `template` defaults to
        `code-interpreter` (`base` has Python and starts faster); `env` is
        its runs' environment, `timeout_seconds` a run's limit (1 to 900,
        300 by default), `public` makes it answer HTTP at its `url`. With
        code and `wait`, it is returned once deployed (`ready`), else
        `FunctionDeployError` or, after `timeout` seconds,
        `FunctionDeployTimeoutError`; without `wait`, `deploying`.
        Interrupted while waiting (Ctrl-C, a cancelled task), it deletes
        the function it was making."""
        encoded = None
        if code is not None:
            encoded = base64.b64encode(code.encode() if isinstance(code, str) else bytes(code)).decode("ascii")
        body = gen.CreateFunctionBody(
            name=name, runtime=runtime, entrypoint=entrypoint, code=encoded, template=template, public=public,
            env=dict(env) if env is not None else None, timeout_seconds=timeout_seconds,
        )
        info = await self._transport.request(api.create_function(body))
        if not wait or info.status != "deploying":
            return info
        try:
            return await self.wait(info.id, timeout=timeout)
        except INTERRUPTIONS:
            # The caller never got its id, and its name stays taken while it is kept.
            await run_shielded(lambda: self._delete_if_present(info.id))
            raise

    async def _delete_if_present(self, function_id: str) -> None:
        try:
            await self.delete(function_id)
        except NotFoundError:
            pass

    async def deploy(
        self,
        function_id: str,
        source: BundleSource,
        *,
        entrypoint: Optional[str] = None,
        wait: bool = True,
        timeout: float = FUNCTION_WAIT_TIMEOUT,
    ) -> gen.FunctionInfo:
        """New code for the function: a directory (its files, without
        node_modules, __pycache__, .git, .venv, venv, dist, .next and
        .turbo), a file (a `.tar.gz` / `.tgz` as it is, any other as a
        bundle of that one file under its name), or a tar.gz's bytes; at
        most 16 MiB compressed. A `requirements.txt` (pip) or `package.json`
        (npm) at its root is installed once, in the deploy. `entrypoint`
        names another file of it to run. `wait` and `timeout` as for
        `create`; a failed deploy leaves the version before it running."""
        bundle = await run_blocking(function_bundle, source)
        info = await self._transport.request(api.deploy_function(function_id, bundle, entrypoint))
        if not wait:
            return info
        return await self.wait(info.id, timeout=timeout)

    async def wait(self, function_id: str, *, timeout: float = FUNCTION_WAIT_TIMEOUT) -> gen.FunctionInfo:
        """The function once its deploy has ended `ready` (or at once if it
        has no code: `empty`). Polls with a growing interval;
        `FunctionDeployError` if the deploy failed, with its `error` and
        `deploy_log`; `FunctionDeployTimeoutError` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        interval = POLL_FIRST
        while True:
            info = await self.get(function_id)
            if info.status in ("ready", "empty"):
                return info
            if info.status == "failed":
                raise FunctionDeployError(info)
            left = deadline - time.monotonic()
            if left <= 0:
                raise FunctionDeployTimeoutError(info, timeout)
            await sleep(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX)

    async def invoke(self, function_id: str, input: Any = None, *, request_timeout: Optional[float] = None) -> gen.FunctionRun:
        """Runs the function once with `input` (any JSON value: its
        handler's `event`, and its stdin) and returns the finished run: its
        `status` (`success`, `error` or `timeout`), `exit_code`, `stdout`,
        `stderr`, and `output`, what the handler returned. A deploy in
        progress is waited for; a function without code (or whose only
        deploy failed) is a `ServiceUnavailableError`. Not retried: the run
        may have happened. `request_timeout`: seconds to wait for the
        answer (960 by default)."""
        return await self._transport.request(api.invoke_function(function_id, input, request_timeout))

    async def runs(self, function_id: str, *, limit: Optional[int] = None) -> List[gen.FunctionRun]:
        """Its runs, newest first (`limit` 1 to 1000, 100 by default; the newest 1000 are kept)."""
        return await self._transport.request(api.function_runs(function_id, limit))

    async def record_run(
        self,
        function_id: str,
        status: str,
        *,
        sandbox_id: Optional[str] = None,
        exit_code: Optional[int] = None,
        stdout: Optional[str] = None,
        stderr: Optional[str] = None,
        duration_ms: Optional[int] = None,
    ) -> gen.FunctionRun:
        """Records a run made elsewhere (nothing is executed): `status`
        `success`, `error`, `timeout` or `running`. It counts in `metrics`."""
        body = gen.RecordRunBody(status=status, sandbox_id=sandbox_id, exit_code=exit_code, stdout=stdout, stderr=stderr,
                                 duration_ms=duration_ms)
        return await self._transport.request(api.record_function_run(function_id, body))

    async def metrics(self, function_id: str, *, period_hours: int = 24) -> gen.Metrics:
        """Its finished runs of the last `period_hours` (1 to 720): count,
        errors and error rate, p50/p95/p99 latency, cold-start rate."""
        return await self._transport.request(api.function_metrics(function_id, period_hours))

    async def code(self, function_id: str) -> bytes:
        """Its code, as the tar.gz the server keeps (`ServiceUnavailableError` without code)."""
        return await self._transport.request(api.function_code(function_id))

    async def list(self) -> List[gen.FunctionInfo]:
        """The workspace's functions, oldest first."""
        return await self._transport.request(api.list_functions())

    async def get(self, function_id: str) -> gen.FunctionInfo:
        """A function, by its id or its name."""
        return await self._transport.request(api.get_function(function_id))

    async def update(
        self,
        function_id: str,
        *,
        name: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        public: Optional[bool] = None,
        entrypoint: Optional[str] = None,
        template: Optional[str] = None,
        timeout_seconds: Optional[int] = None,
    ) -> gen.FunctionInfo:
        """Changes what is given. `env` replaces the whole environment; it,
        `public` and `timeout_seconds` apply from the next run. Another
        `entrypoint` or `template` deploys the code again: it is returned
        `deploying` (`wait` waits)."""
        body = gen.PatchFunctionBody(name=name, env=dict(env) if env is not None else None, public=public, entrypoint=entrypoint,
                                     template=template, timeout_seconds=timeout_seconds)
        return await self._transport.request(api.update_function(function_id, body))

    async def delete(self, function_id: str) -> None:
        """Deletes it with its runs, its schedules and its snapshot."""
        await self._transport.request(api.delete_function(function_id))


class AsyncSchedules:
    """Cron schedules that invoke a function. Each due run fires once,
    whichever server of a cluster claims it; runs missed while no server
    ran are not replayed (a late one is recorded `skipped`)."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(
        self,
        name: str,
        function_id: str,
        cron: str,
        *,
        timezone: Optional[str] = None,
        paused: bool = False,
        input: Any = None,
    ) -> gen.ScheduleInfo:
        """A schedule of the function (its id or name): `cron` has five
        fields (`0 9 * * 1-5`) or is `@hourly`, `@daily`, `@weekly`,
        `@monthly` or `@yearly`, read in `timezone` (IANA, `UTC` by
        default). Each run gets `input`."""
        body = gen.CreateScheduleBody(name=name, function_id=function_id, cron=cron, timezone=timezone, paused=paused, input=input)
        return await self._transport.request(api.create_schedule(body))

    async def list(self) -> List[gen.ScheduleInfo]:
        """The workspace's schedules, oldest first."""
        return await self._transport.request(api.list_schedules())

    async def get(self, schedule_id: str) -> gen.ScheduleInfo:
        """A schedule, by its id or its name."""
        return await self._transport.request(api.get_schedule(schedule_id))

    async def update(
        self,
        schedule_id: str,
        *,
        name: Optional[str] = None,
        cron: Optional[str] = None,
        timezone: Optional[str] = None,
        paused: Optional[bool] = None,
        input: Any = None,
    ) -> gen.ScheduleInfo:
        """Changes what is given (`None` keeps it). Its next run is computed anew from now."""
        body = gen.PatchScheduleBody(name=name, cron=cron, timezone=timezone, paused=paused, input=input)
        return await self._transport.request(api.update_schedule(schedule_id, body))

    async def pause(self, schedule_id: str) -> gen.ScheduleInfo:
        """Stops its runs (`next_run_at` None) until `resume`."""
        return await self.update(schedule_id, paused=True)

    async def resume(self, schedule_id: str) -> gen.ScheduleInfo:
        """Runs it again, its next run counted from now (missed runs are not made up)."""
        return await self.update(schedule_id, paused=False)

    async def trigger(self, schedule_id: str, *, request_timeout: Optional[float] = None) -> gen.FunctionRun:
        """Runs its function now, with its input, and returns the finished
        run (its `schedule_id` set); its cron is unchanged. As `invoke`."""
        return await self._transport.request(api.trigger_schedule(schedule_id, request_timeout))

    async def runs(self, schedule_id: str, *, limit: Optional[int] = None) -> List[gen.FunctionRun]:
        """The runs it fired, and those it skipped, newest first."""
        return await self._transport.request(api.schedule_runs(schedule_id, limit))

    async def delete(self, schedule_id: str) -> None:
        """Deletes it; its runs stay with its function."""
        await self._transport.request(api.delete_schedule(schedule_id))


class AsyncApps:
    """Apps: services deployed from git. Each deployment fetches a branch,
    tag or commit, builds it in a sandbox of its own and goes live when its
    port answers HTTP; the app's host name, `{name}.{suffix}` (its `url`),
    then serves it. Earlier deployments keep their sandbox, hibernated, so
    that a rollback is a switch, not a rebuild. `app_id` is an app's id or
    its name."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(
        self,
        name: str,
        git_url: str,
        *,
        git_branch: Optional[str] = None,
        framework: Optional[str] = None,
        install_command: Optional[str] = None,
        build_command: Optional[str] = None,
        start_command: Optional[str] = None,
        root_directory: Optional[str] = None,
        port: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        template: Optional[str] = None,
        cpu: Optional[int] = None,
        memory_mb: Optional[int] = None,
        auto_hibernate: Optional[bool] = None,
        idle_timeout_seconds: Optional[int] = None,
        keep_deployments: Optional[int] = None,
    ) -> gen.AppInfo:
        """A new app, `created`: nothing runs until `deploy`. `name` is the
        first label of its host name (1 to 40 lowercase letters, digits and
        `-`), unique on the server: a `ConflictError` when taken, whoever
        has it. `git_url` is https, http, ssh or `user@host:path`. The
        branch defaults to `main`, the `port` its process listens on (it
        gets it as `$PORT`) to 3000; `framework` (`nextjs`, `vite`, `node`,
        `python`, `static`, `custom`) is detected at each deployment unless
        given, and with it the commands and the template. `env` holds plain
        variables (`set_env` for secrets). `auto_hibernate` puts the live
        deployment to sleep after `idle_timeout_seconds` (600) without
        requests; `keep_deployments` (3) earlier ones stay for `rollback`."""
        body = gen.AppBody(
            name=name, git_url=git_url, git_branch=git_branch, framework=framework, install_command=install_command,
            build_command=build_command, start_command=start_command, root_directory=root_directory, port=port,
            env=dict(env) if env is not None else None, template=template, cpu=cpu, memory_mb=memory_mb,
            auto_hibernate=auto_hibernate, idle_timeout_seconds=idle_timeout_seconds, keep_deployments=keep_deployments,
        )
        return await self._transport.request(api.create_app(body))

    async def list(self) -> List[gen.AppInfo]:
        """The workspace's apps, oldest first."""
        return await self._transport.request(api.list_apps())

    async def get(self, app_id: str) -> gen.AppInfo:
        """An app: its `status` (`created`, `deploying`, `live`, `failed`),
        and its `url` and live deployment once one is live."""
        return await self._transport.request(api.get_app(app_id))

    async def update(
        self,
        app_id: str,
        *,
        name: Optional[str] = None,
        git_url: Optional[str] = None,
        git_branch: Optional[str] = None,
        framework: Optional[str] = None,
        install_command: Optional[str] = None,
        build_command: Optional[str] = None,
        start_command: Optional[str] = None,
        root_directory: Optional[str] = None,
        port: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        template: Optional[str] = None,
        cpu: Optional[int] = None,
        memory_mb: Optional[int] = None,
        auto_hibernate: Optional[bool] = None,
        idle_timeout_seconds: Optional[int] = None,
        keep_deployments: Optional[int] = None,
    ) -> gen.AppInfo:
        """Changes what is given (`None` keeps it; `""` clears a command,
        the template, the root directory or the framework, detected again).
        `env` sets those plain variables; the others stay. The settings
        apply from the next deployment."""
        body = gen.AppBody(
            name=name, git_url=git_url, git_branch=git_branch, framework=framework, install_command=install_command,
            build_command=build_command, start_command=start_command, root_directory=root_directory, port=port,
            env=dict(env) if env is not None else None, template=template, cpu=cpu, memory_mb=memory_mb,
            auto_hibernate=auto_hibernate, idle_timeout_seconds=idle_timeout_seconds, keep_deployments=keep_deployments,
        )
        return await self._transport.request(api.update_app(app_id, body))

    async def delete(self, app_id: str) -> None:
        """Deletes it: its host name stops answering and its deployments' sandboxes are removed."""
        await self._transport.request(api.delete_app(app_id))

    async def deploy(
        self, app_id: str, git_ref: Optional[str] = None, *, wait: bool = True, timeout: float = APP_DEPLOY_WAIT_TIMEOUT
    ) -> gen.DeploymentInfo:
        """A new deployment of `git_ref` (a branch, tag or commit; the app's
        branch by default), built beside the live one. With `wait` it is
        returned once over (`wait` says how); without, `queued`: follow it
        with `deploy_logs` or `deployment`. A failed deployment leaves the
        live one serving."""
        deployment = await self._transport.request(api.deploy_app(app_id, git_ref))
        if not wait:
            return deployment
        return await self.wait(app_id, deployment.id, timeout=timeout)

    async def wait(self, app_id: str, deployment_id: str, *, timeout: float = APP_DEPLOY_WAIT_TIMEOUT) -> gen.DeploymentInfo:
        """The deployment, with its `build_logs`, once it is over: `live`
        (or `superseded`, when a newer one went live first). Polls with a
        growing interval; `AppDeployError` if it failed, with its `error`
        and `build_logs`; `AppDeployTimeoutError` after `timeout` seconds
        (it goes on)."""
        deadline = time.monotonic() + timeout
        interval = POLL_FIRST
        while True:
            deployment = await self.deployment(app_id, deployment_id)
            if deployment.status == "failed":
                raise AppDeployError(deployment)
            if deployment.status not in ("queued", "building", "deploying"):
                return deployment
            left = deadline - time.monotonic()
            if left <= 0:
                raise AppDeployTimeoutError(deployment, timeout)
            await sleep(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX)

    async def deployments(self, app_id: str) -> List[gen.DeploymentInfo]:
        """Its deployments, newest first, without their logs."""
        return await self._transport.request(api.list_deployments(app_id))

    async def deployment(self, app_id: str, deployment_id: str) -> gen.DeploymentInfo:
        """A deployment, with its `build_logs` so far."""
        return await self._transport.request(api.get_deployment(app_id, deployment_id))

    def deploy_logs(self, app_id: str, deployment_id: str, *, request_timeout: Optional[float] = None) -> AsyncStream[str]:
        """The deployment's log lines: those written so far, then each as it
        is written, until the deployment is over. Leaving the loop early
        closes the stream, not the deployment. `request_timeout`: seconds
        the stream may stay silent (1800 by default)."""
        call = api.deployment_logs(app_id, deployment_id, request_timeout)

        async def lines() -> AsyncEvents[str]:
            async with self._transport.stream(call) as response:
                yield None
                async for sse in async_sse_events(response):
                    if sse.event == "done":
                        return
                    if sse.event == "message":
                        yield sse.data
            raise StreamError("the deployment's log ended before the deployment did")

        return AsyncStream(lines())

    async def rollback(self, app_id: str) -> gen.DeploymentInfo:
        """Puts the newest earlier deployment that kept its sandbox back
        live, in one switch (no rebuild; its sandbox wakes), and returns it;
        the one it replaces becomes `rolled_back`. A `ConflictError` when
        nothing is live or nothing earlier is kept."""
        return await self._transport.request(api.rollback_app(app_id))

    async def env(self, app_id: str) -> List[gen.AppEnvVar]:
        """Its variables; a secret's `value` is masked (`••••••••`)."""
        return await self._transport.request(api.list_app_env(app_id))

    async def set_env(self, app_id: str, key: str, value: str, *, secret: bool = False, scope: Optional[str] = None) -> gen.AppEnvSet:
        """Sets a variable for its next deployments. A `secret` is never
        shown again; `scope` `all` (the default) or `production` reach
        deployments, `preview` none."""
        return await self._transport.request(api.set_app_env(app_id, key, gen.SetEnvBody(value=value, secret=secret, scope=scope)))

    async def unset_env(self, app_id: str, key: str) -> None:
        """Removes a variable (`NotFoundError` when it has none of that name)."""
        await self._transport.request(api.unset_app_env(app_id, key))

    async def import_env(self, app_id: str, dotenv: str, *, secret: bool = False, scope: Optional[str] = None) -> gen.AppEnvImported:
        """Sets every variable of a `.env` file's text (`KEY=value` lines;
        comments, `export` and quotes as shells read them)."""
        return await self._transport.request(api.import_app_env(app_id, gen.ImportEnvBody(dotenv=dotenv, secret=secret, scope=scope)))

    async def runtime_logs(self, app_id: str, *, limit: Optional[int] = None) -> str:
        """The end of what the live deployment's process printed: at most
        `limit` bytes (64 KiB by default, 1 MiB at most).
        `ConflictError` when nothing is live."""
        return await self._transport.request(api.app_runtime_logs(app_id, limit))
