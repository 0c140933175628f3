"""The SDK compatibility suite: the unmodified PandaStack Python SDK
(`pandastack==0.10.0`, installed by scripts/install-sdk-deps) against a real
`clade server` with real VMs.

Fixtures start the built binary (`CLADE_BIN`, default target/release/clade)
as `clade server --data-dir <tmp> --listen 127.0.0.1:<port>`: one server for
the session, and dedicated ones for tests that kill theirs or need other
settings. A test that needs root, QEMU or the binary skips with the reason,
but fails when `CI` is set, so a CI machine that lacks them cannot pass by
skipping. On a failure the tail of the server's log is attached to the
report, and the logs of the run are kept (path printed at the end).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pandastack
import pytest

# The helpers shared with the other suites (also for soak.py, run outside pytest).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
import clade_harness  # noqa: E402
from clade_harness import (  # noqa: E402,F401 (the tests import these from here)
    BIN, REPO, free_port, kill_all, log_tail, processes_under, skip_or_fail, wait_for,
)

# The template every test uses: the image every host has (§3.11).
TEMPLATE = "base"
# Kept when a test fails: the server logs of this run.
ARTIFACTS = Path(os.environ.get("CLADE_SDK_ARTIFACTS", "/tmp/clade-sdk-artifacts"))
# The standby pool remembers a burst for 30 s instead of 10 min, so that
# tests that count what the server holds (the soak) see it shrink back.
# Apps may be deployed from file:// repositories (test_apps makes its own).
SHARED_SERVER_ARGS = ["--standby-horizon", "30", "--apps-allow-file-urls"]


def missing_requirement() -> Optional[str]:
    return clade_harness.missing_requirement("the SDK suite")


class CladeServer(clade_harness.CladeServer):
    """One `clade server` of this suite; its log is kept in ARTIFACTS when asked."""

    def __init__(self, name: str, env: Optional[Dict[str, str]] = None, args: Optional[List[str]] = None):
        super().__init__("sdk", name, args=args, env=env, artifacts=ARTIFACTS)

    def client(self, key: Optional[str] = None, **kwargs) -> pandastack.Client:
        return pandastack.Client(api_key=key or self.admin_key, api_url=self.url, **kwargs)


_failed = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _failed
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _failed = True
    clade_harness.attach_server_logs(report)


def pytest_sessionfinish(session, exitstatus):
    if _failed and ARTIFACTS.exists():
        print(f"\nclade server logs of this run: {ARTIFACTS}")


@pytest.fixture(scope="session")
def requirements() -> None:
    reason = missing_requirement()
    if reason:
        skip_or_fail(reason)


@pytest.fixture
def start_server(requirements):
    """Starts dedicated servers for one test: `start_server(name, env=..., args=...)`."""
    servers: List[CladeServer] = []

    def start(name: str, env: Optional[Dict[str, str]] = None, args: Optional[List[str]] = None) -> CladeServer:
        server = CladeServer(name, env=env, args=args)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.teardown(keep_log=_failed)


@pytest.fixture(scope="session")
def server(requirements) -> Iterator[CladeServer]:
    server = CladeServer("main", args=SHARED_SERVER_ARGS).start()
    yield server
    server.teardown(keep_log=_failed)


@pytest.fixture(scope="session")
def client(server) -> pandastack.Client:
    return server.client()


@pytest.fixture(scope="session")
def other_client(server) -> pandastack.Client:
    """A client of another workspace (`other`) of the same server."""
    return server.client(server.create_key("other"))


@pytest.fixture(scope="session")
def sandbox(client) -> Iterator[pandastack.Sandbox]:
    """A sandbox shared by the tests that only run things in it (exec, files);
    with an idle TTL longer than the suite, so the reaper leaves it alone."""
    sb = client.sandboxes.create(template=TEMPLATE, ttl_seconds=3600)
    yield sb
    try:
        sb.kill()
    except pandastack.PandastackError:
        pass


@pytest.fixture
def fresh_sandbox(client) -> Iterator[pandastack.Sandbox]:
    """A sandbox of its own, for a test that changes its state."""
    sb = client.sandboxes.create(template=TEMPLATE)
    yield sb
    try:
        sb.kill()
    except pandastack.PandastackError:
        pass

