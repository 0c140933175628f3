"""The E2B compatibility suite: the unmodified E2B Python SDKs (`e2b`,
`e2b-code-interpreter`, pinned in requirements.txt) against one real
`clade server` with real VMs, configured the way an E2B user would point
them at a self-hosted E2B: `E2B_API_URL` and `E2B_SANDBOX_URL` at the
server, `E2B_API_KEY` a Clade key.

The server is the built binary (`CLADE_BIN`, default target/release/clade)
as `clade server --data-dir <tmp> --listen 127.0.0.1:<port>`, shared by the
whole session. Sandboxes are few (each is a VM, possibly under TCG on a
small machine): the tests that only run things share one, the others make
their own and kill it. A test that needs root, QEMU, the binary or the
code-interpreter template skips with the reason, but fails when `CI` is
set. On a failure the tail of the server's log is attached to the report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from e2b import Sandbox, SandboxInfo, SandboxQuery

# The helpers shared with the other suites.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from clade_harness import (  # noqa: E402,F401 (the tests import these from here)
    BIN, CladeServer, attach_server_logs, missing_requirement, skip_or_fail, wait_for,
)

# Clade's small image; E2B's `base` template has the same name.
TEMPLATE = "base"
# The first-party image with a Jupyter kernel and the data stack.
CODE_TEMPLATE = "code-interpreter"
# Seconds an SDK request may take (its default is 60): a create or a wake
# boots or restores a VM, under QEMU TCG on a loaded 2-core machine.
REQUEST_TIMEOUT = 120
# Seconds a sandbox of this suite lives unused: longer than the suite, so
# only the tests about timeouts see one go.
SANDBOX_TIMEOUT = 3600
# Building the code-interpreter image, when it is not cached yet.
IMAGE_BUILD_TIMEOUT = 1800
# Tags every sandbox of this run, so that listing by metadata finds only ours.
RUN = uuid.uuid4().hex[:12]
# What the SDKs read from the environment; set for the session, restored after.
E2B_VARIABLES = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG", "E2B_HTTP_VERSION", "SSL_CERT_FILE")


# The modules in the order that makes a failure easiest to read: the
# control plane first, then envd, the lifecycle, the interpreter last.
MODULE_ORDER = ["test_sandboxes", "test_commands", "test_files", "test_pty", "test_binary_codec", "test_lifecycle", "test_code_interpreter"]


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = getattr(item, "module", None)
        name = module.__name__ if module is not None else ""
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    items.sort(key=rank)  # stable: a module's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    attach_server_logs(outcome.get_result())


def e2b_key(server: CladeServer, workspace: str) -> str:
    """A key of `workspace` in E2B's form (`clade keys create --format e2b`
    prints `e2b_<40 hex>`), or a plain Clade key while the CLI has no such
    option: the SDK sends either as `X-API-KEY` and checks no format."""
    command = [str(server.bin), "keys", "create", "--workspace", workspace, "--data-dir", str(server.data_dir)]
    out = subprocess.run([*command, "--format", "e2b"], capture_output=True, text=True, env=server.env, timeout=60)
    if out.returncode != 0 and "--format" in out.stderr:
        return server.create_key(workspace)
    if out.returncode != 0:
        raise RuntimeError(f"clade keys create --format e2b failed:\n{out.stderr}")
    key = out.stdout.strip().splitlines()[-1].strip()
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", key), f"not an E2B key: {key!r}"
    server.keys.append(key)
    return key


def list_all(query: Optional[SandboxQuery] = None, **opts: Any) -> List[SandboxInfo]:
    """Every page of `Sandbox.list`."""
    paginator = Sandbox.list(query=query, request_timeout=REQUEST_TIMEOUT, **opts)
    found: List[SandboxInfo] = []
    while paginator.has_next:
        found.extend(paginator.next_items())
    return found


def kill_quietly(sandbox_id: str, **opts: Any) -> None:
    try:
        Sandbox.kill(sandbox_id, request_timeout=REQUEST_TIMEOUT, **opts)
    except Exception:  # noqa: BLE001 (cleanup after a test: what failed is already reported)
        pass


def new_sandbox(metadata: Optional[Dict[str, str]] = None, template: str = TEMPLATE, **kwargs: Any) -> Sandbox:
    """`Sandbox.create` with this suite's template, timeouts and run tag."""
    kwargs.setdefault("timeout", SANDBOX_TIMEOUT)
    kwargs.setdefault("request_timeout", REQUEST_TIMEOUT)
    return Sandbox.create(template=template, metadata={"run": RUN, **(metadata or {})}, **kwargs)


@contextmanager
def own_sandbox(**kwargs: Any) -> Iterator[Sandbox]:
    """A sandbox for one test, killed after it whatever happened."""
    sandbox = new_sandbox(**kwargs)
    try:
        yield sandbox
    finally:
        kill_quietly(sandbox.sandbox_id)


@pytest.fixture(scope="session")
def server() -> Iterator[CladeServer]:
    reason = missing_requirement("the E2B suite")
    if reason:
        skip_or_fail(reason)
    # Over TLS with the server's own CA, as an E2B user's SDK reaches E2B:
    # HTTPS, and HTTP/2 by ALPN for envd's Connect calls (the JS suite
    # covers plain HTTP/1.1).
    server = CladeServer("e2b", args=["--standby-horizon", "30"], tls=True).start()
    try:
        yield server
    finally:
        server.teardown()


@pytest.fixture(scope="session")
def e2b(server: CladeServer) -> Iterator[str]:
    """Points the SDKs at the server (control plane and sandboxes alike)
    with a key of workspace `e2b`; yields the key. Kills what is left of
    the run's sandboxes at the end."""
    key = e2b_key(server, "e2b")
    saved = {name: os.environ.get(name) for name in E2B_VARIABLES}
    for name in E2B_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=key)
    if server.ca_path is not None:
        os.environ["SSL_CERT_FILE"] = str(server.ca_path)
    try:
        yield key
    finally:
        try:
            for info in list_all(SandboxQuery(metadata={"run": RUN})):
                kill_quietly(info.sandbox_id)
        except Exception:  # noqa: BLE001 (the server's teardown deletes what is left too)
            pass
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def other_key(server: CladeServer, e2b: str) -> str:
    """A key of another workspace (`other`) of the same server."""
    return e2b_key(server, "other")


@pytest.fixture(scope="session")
def sandbox(e2b: str) -> Iterator[Sandbox]:
    """The sandbox the tests that only run things in it share (commands,
    files, PTY, isolation); each works in paths and processes of its own."""
    with own_sandbox(metadata={"role": "shared"}) as shared:
        yield shared


@pytest.fixture(scope="session")
def code_template(server: CladeServer) -> str:
    """The code-interpreter template, built if needed (cached under /var/cache/clade)."""
    out = subprocess.run([str(server.bin), "images", "build", "--image", CODE_TEMPLATE], capture_output=True,
                         text=True, env=server.env, timeout=IMAGE_BUILD_TIMEOUT)
    if out.returncode != 0:
        skip_or_fail(f"the {CODE_TEMPLATE} template cannot be built:\n{out.stderr[-2000:]}")
    return CODE_TEMPLATE
