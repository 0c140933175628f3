"""The SDK's suite against a real `clade server` with real VMs.

One server for the whole session (`server`), started from a copy of the
binary (`CLADE_BIN`, default target/release/clade) so that a rebuild while
the suite runs cannot swap it mid-way. A test that needs root, QEMU or the
binary skips with the reason, but fails when `CI` is set."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest

import clade

# The helpers shared with the other suites.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "harness"))
from clade_harness import REPO as REPO  # noqa: E402 (`as`: re-exported, for mypy --strict)
from clade_harness import CladeServer, attach_server_logs, missing_requirement, skip_or_fail  # noqa: E402

SDK_DIR = REPO / "sdk" / "python"
#: Commands get a generous timeout: two cores, QEMU in TCG, other suites beside.
EXEC_TIMEOUT = 120
# The tests' name for the server they get.
Server = CladeServer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    outcome = yield
    attach_server_logs(outcome.get_result())  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def requirements() -> None:
    reason = missing_requirement("the suite", accept_own_qemu=True)
    if reason:
        skip_or_fail(reason)


@pytest.fixture(scope="session")
def server(requirements: None) -> Iterator[Server]:
    # Apps may be deployed from file:// repositories (test_apps makes its own).
    server = Server("sdk-python", args=["--standby-horizon", "30", "--apps-allow-file-urls"], copy_binaries=True).start(timeout=90.0)
    yield server
    server.teardown()


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[clade.Clade]:
    with clade.Clade(api_key=server.admin_key, api_url=server.url) as client:
        yield client


@pytest.fixture
async def aclient(server: Server) -> Any:
    async with clade.AsyncClade(api_key=server.admin_key, api_url=server.url + "/v1") as client:
        yield client


@pytest.fixture(scope="session")
def other_client(server: Server) -> Iterator[clade.Clade]:
    """A client of another workspace of the same server."""
    with clade.Clade(api_key=server.create_key("other"), api_url=server.url) as client:
        yield client


@pytest.fixture(scope="session")
def sandbox(client: clade.Clade) -> Iterator[clade.Sandbox]:
    """A `base` sandbox shared by tests that only run things in it."""
    sb = client.sandboxes.create("base", ttl_seconds=3600, metadata={"suite": "sdk-python"})
    yield sb
    try:
        sb.delete()
    except clade.NotFoundError:
        pass


@pytest.fixture(scope="session")
def code_interpreter_ready(client: clade.Clade) -> None:
    templates = {t.name: t for t in client.templates.list()}
    template = templates.get("code-interpreter")
    if template is None or not template.ready:
        skip_or_fail("the code-interpreter template is not built on this host (clade images build --image code-interpreter)")


@pytest.fixture(scope="session")
def postgres_ready(client: clade.Clade) -> None:
    """The `postgres` image that databases are made from is built here."""
    try:
        ready = client.templates.get("postgres").ready
    except clade.NotFoundError:
        ready = False
    if not ready:
        skip_or_fail("the postgres image is not built on this host (clade images build --image postgres)")


def sleep_600_processes(sb: clade.Sandbox) -> str:
    """The `sleep 600` processes left in the sandbox (`60[0]`: so that the
    shell running pgrep, whose command line holds the pattern, is not one)."""
    return sb.exec('pgrep -af "sleep 60[0]" || true', timeout=EXEC_TIMEOUT).stdout.strip()


def assert_no_sleep_600_left(sb: clade.Sandbox) -> None:
    """The abort reached the guest: within ~5 s nothing of `sleep 600` is left."""
    deadline = time.monotonic() + 5
    while True:
        left = sleep_600_processes(sb)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the aborted command still runs in the guest:\n{left}")
        time.sleep(0.5)


def env_for(server: Server, key: Optional[str] = None) -> Dict[str, str]:
    return {**os.environ, "CLADE_API_URL": server.url, "CLADE_API_KEY": key or server.admin_key}
