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
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pandastack
import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CLADE_BIN", REPO / "target" / "release" / "clade"))
# The template every test uses: the image every host has (§3.11).
TEMPLATE = "base"
# Kept when a test fails: the server logs of this run.
ARTIFACTS = Path(os.environ.get("CLADE_SDK_ARTIFACTS", "/tmp/clade-sdk-artifacts"))


def in_ci() -> bool:
    return os.environ.get("CI", "") not in ("", "false", "0")


def skip_or_fail(reason: str) -> None:
    """Skips the calling test, or fails it when `CI` is set."""
    if in_ci():
        pytest.fail(f"required for this test in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_requirement() -> Optional[str]:
    """Why this machine cannot run the server with VMs, or None."""
    if os.geteuid() != 0:
        return "the SDK suite needs root (the server boots QEMU VMs)"
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

    started: List["CladeServer"] = []

    def __init__(self, name: str, env: Optional[Dict[str, str]] = None, args: Optional[List[str]] = None):
        self.name = name
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"clade-sdk-{name}-"))
        self.log_path = self.data_dir / "server.log"
        self.env = {**os.environ, "NO_COLOR": "1", **(env or {})}
        # The static guest agent of this checkout (what scripts/build makes),
        # when the binary under test is not in it (CLADE_BIN elsewhere).
        guestd = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "clade-guestd"
        if "CLADE_GUESTD" not in self.env and guestd.is_file():
            self.env["CLADE_GUESTD"] = str(guestd)
        self.args = list(args or [])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.admin_key = ""
        self.keys: List[str] = []

    def start(self, timeout: float = 60.0) -> "CladeServer":
        cmd = [str(BIN), "server", "--data-dir", str(self.data_dir), "--listen", f"127.0.0.1:{self.port}", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True
            )
        CladeServer.started.append(self)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clade server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"clade server did not answer /healthz in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)
        if not self.admin_key:
            self.admin_key = (self.data_dir / "admin.key").read_text().strip()
            self.keys.append(self.admin_key)
        return self

    def create_key(self, workspace: str) -> str:
        """A key of `workspace` (created if needed), made with `clade keys create`."""
        out = subprocess.run(
            [str(BIN), "keys", "create", "--workspace", workspace, "--data-dir", str(self.data_dir)],
            capture_output=True, text=True, env=self.env, check=True, timeout=60,
        )
        key = out.stdout.strip().splitlines()[-1].strip()
        self.keys.append(key)
        return key

    def client(self, key: Optional[str] = None, **kwargs) -> pandastack.Client:
        return pandastack.Client(api_key=key or self.admin_key, api_url=self.url, **kwargs)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def delete_all_sandboxes(self) -> None:
        """Removes every sandbox of every key this fixture knows (best effort)."""
        if not self.alive():
            return
        for key in self.keys:
            session = requests.Session()
            session.headers["Authorization"] = f"Bearer {key}"
            try:
                listed = session.get(f"{self.url}/v1/sandboxes", timeout=30).json()
            except (requests.RequestException, ValueError):
                continue
            items = listed.get("items", []) if isinstance(listed, dict) else listed
            for sandbox in items or []:
                try:
                    session.delete(f"{self.url}/v1/sandboxes/{sandbox['id']}", timeout=60)
                except requests.RequestException:
                    pass

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then SIGKILL if it does not stop in time."""
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)

    def vm_pids(self) -> List[int]:
        """Processes (QEMU, holders) started for VMs under this data directory."""
        return processes_under(self.data_dir, self.proc.pid if self.proc else None)

    def teardown(self, keep_log: bool) -> None:
        """Deletes the sandboxes, stops the server, kills VMs left behind (by
        pid: a server killed on purpose leaves its VMs running), keeps the
        log when asked, and removes the data directory."""
        try:
            self.delete_all_sandboxes()
        finally:
            self.stop()
            kill_all(self.vm_pids())
            if keep_log and self.log_path.exists():
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.log_path, ARTIFACTS / f"{self.data_dir.name}.log")
            # Mounts or files of VMs killed a moment ago may linger briefly.
            for _ in range(5):
                shutil.rmtree(self.data_dir, ignore_errors=True)
                if not self.data_dir.exists():
                    break
                time.sleep(0.5)

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)


SHARED_SERVER_ARGS = ["--standby-horizon", "30"]


def kill_all(pids: List[int]) -> None:
    """SIGKILL to each of `pids` that still runs."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def processes_under(directory: Path, exclude: Optional[int] = None) -> List[int]:
    """Processes whose command line names `directory` (a data directory's
    QEMUs and holders), but this one and `exclude`."""
    marker = str(directory).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), exclude):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def log_tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


_failed = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _failed
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _failed = True
        for server in CladeServer.started:
            report.sections.append((f"clade server {server.name} ({server.log_path})", server.log_tail()))


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
        CladeServer.started.remove(server)


@pytest.fixture(scope="session")
def server(requirements) -> Iterator[CladeServer]:
    # The standby pool remembers a burst for 30 s instead of 10 min, so that
    # tests that count what the server holds (the soak) see it shrink back.
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


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
