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

import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator, Optional

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

# The helpers shared with the other suites.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from clade_harness import (  # noqa: E402,F401 (the tests import these from here)
    BIN, CladeServer, attach_server_logs, missing_requirement, skip_or_fail, wait_for,
)

TRANSPORTS = ["stdio", "http"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    attach_server_logs(outcome.get_result())


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def server() -> Iterator[CladeServer]:
    reason = missing_requirement("the MCP suite")
    if reason:
        skip_or_fail(reason)
    server = CladeServer("mcp", args=["--standby-horizon", "30"]).start()
    try:
        yield server
    finally:
        server.teardown()


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

