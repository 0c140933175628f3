"""The MCP suite: the official MCP Python SDK (`mcp`, pinned in
requirements.txt) as the client of Clade's MCP server, over stdio
(`clade mcp` with CLADE_API_URL/CLADE_API_KEY) and over streamable HTTP
(`clade server`'s /mcp with an Authorization header), against one real
`clade server` with real VMs.

The server is the built binary (`CLADE_BIN`, default target/release/clade)
as `clade server --data-dir <tmp> --listen 127.0.0.1:<port>`, shared by the
whole session. A test that needs root, QEMU, the binary or the
code-interpreter template skips with the reason, but fails when `CI` is
set. On a failure the tail of the server's log is attached to the report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Tuple

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CLADE_BIN", REPO / "target" / "release" / "clade"))
TRANSPORTS = ["stdio", "http"]


def in_ci() -> bool:
    return os.environ.get("CI", "") not in ("", "false", "0")


def skip_or_fail(reason: str) -> None:
    """Skips the calling test, or fails it when `CI` is set."""
    if in_ci():
        pytest.fail(f"required for this test in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_requirement() -> Optional[str]:
    if os.geteuid() != 0:
        return "the MCP suite needs root (the server boots QEMU VMs)"
    qemu = os.environ.get("CLADE_QEMU", "qemu-system-x86_64")
    if shutil.which(qemu) is None:
        return f"{qemu} is not installed (scripts/install-host-deps)"
    if not BIN.is_file():
        return f"{BIN} does not exist (scripts/build, or point CLADE_BIN at a clade binary)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CladeServer:
    """One `clade server` process over a private data directory."""

    def __init__(self) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="clade-mcp-"))
        self.log_path = self.data_dir / "server.log"
        self.env = {**os.environ, "NO_COLOR": "1"}
        guestd = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "clade-guestd"
        if "CLADE_GUESTD" not in self.env and guestd.is_file():
            self.env["CLADE_GUESTD"] = str(guestd)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.admin_key = ""
        self.keys: List[str] = []

    def start(self, timeout: float = 60.0) -> "CladeServer":
        cmd = [str(BIN), "server", "--data-dir", str(self.data_dir), "--listen", f"127.0.0.1:{self.port}",
               "--standby-horizon", "30"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clade server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"clade server did not answer /healthz in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)
        self.admin_key = (self.data_dir / "admin.key").read_text().strip()
        self.keys.append(self.admin_key)
        return self

    def create_key(self, workspace: str) -> str:
        out = subprocess.run([str(BIN), "keys", "create", "--workspace", workspace, "--data-dir", str(self.data_dir)],
                             capture_output=True, text=True, env=self.env, check=True, timeout=60)
        key = out.stdout.strip().splitlines()[-1].strip()
        self.keys.append(key)
        return key

    def api(self, method: str, path: str, key: Optional[str] = None, body: Any = None,
            headers: Optional[Dict[str, str]] = None, timeout: float = 120) -> Tuple[int, Any]:
        """One call of the HTTP API: its status and its JSON (or text)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        if key is not None:
            request.add_header("Authorization", f"Bearer {key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                status, text = answer.status, answer.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode(errors="replace")
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def delete_all_sandboxes(self) -> None:
        for key in self.keys:
            status, listed = self.api("GET", "/v1/sandboxes", key)
            items = listed.get("items", []) if isinstance(listed, dict) else (listed or [])
            for sandbox in items if status == 200 else []:
                self.api("DELETE", f"/v1/sandboxes/{sandbox['id']}", key)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


_servers: List[CladeServer] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in _servers:
            report.sections.append((f"clade server ({server.log_path})", server.log_tail()))


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def server() -> Iterator[CladeServer]:
    reason = missing_requirement()
    if reason:
        skip_or_fail(reason)
    server = CladeServer().start()
    _servers.append(server)
    try:
        yield server
    finally:
        try:
            server.delete_all_sandboxes()
        finally:
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def other_key(server: CladeServer) -> str:
    """A key of another workspace (`other`) of the same server."""
    return server.create_key("other")


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@asynccontextmanager
async def connect(transport: str, server: CladeServer, key: Optional[str] = None) -> AsyncIterator[Client]:
    """An MCP session with Clade's MCP server over `transport`, as `key` (default: the admin key)."""
    key = key or server.admin_key
    if transport == "stdio":
        params = StdioServerParameters(
            command=str(BIN),
            args=["mcp"],
            # No config file: the environment alone names the server and key.
            env={"CLADE_API_URL": server.url, "CLADE_API_KEY": key, "CLADE_CONFIG": "/nonexistent", "CLADE_LOG": "info"},
        )
        client = Client(params, read_timeout_seconds=240)
    else:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
        client = Client(streamable_http_client(f"{server.url}/mcp", http_client=http), read_timeout_seconds=240)
    async with client:
        yield client


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
