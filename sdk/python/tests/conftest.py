"""The SDK's suite against a real `clade server` with real VMs.

One server for the whole session (`server`), started from a copy of the
binary (`CLADE_BIN`, default target/release/clade) so that a rebuild while
the suite runs cannot swap it mid-way. A test that needs root, QEMU or the
binary skips with the reason, but fails when `CI` is set."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import httpx
import pytest

import clade

REPO = Path(__file__).resolve().parents[3]
SDK_DIR = REPO / "sdk" / "python"
BIN = Path(os.environ.get("CLADE_BIN", REPO / "target" / "release" / "clade"))
GUESTD = Path(os.environ.get("CLADE_GUESTD", REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "clade-guestd"))
#: Commands get a generous timeout: two cores, QEMU in TCG, other suites beside.
EXEC_TIMEOUT = 120


def in_ci() -> bool:
    return os.environ.get("CI", "") not in ("", "0", "false")


def skip_or_fail(reason: str) -> None:
    """Skips the calling test, or fails it when `CI` is set."""
    if in_ci():
        pytest.fail(f"required for this test in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_requirement() -> Optional[str]:
    if os.geteuid() != 0:
        return "the suite needs root (the server boots QEMU VMs)"
    qemu = os.environ.get("CLADE_QEMU", "qemu-system-x86_64")
    if shutil.which(qemu) is None and not Path("/var/cache/clade/qemu").exists():
        return f"{qemu} is not installed (scripts/install-host-deps)"
    if not BIN.is_file():
        return f"{BIN} does not exist (scripts/build, or point CLADE_BIN at a clade binary)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A `clade server` over a private data directory, run from copies of the binaries."""

    def __init__(self, name: str, args: Optional[List[str]] = None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"clade-sdk-python-{name}-"))
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "server.log"
        self.bin = self.workdir / "clade"
        shutil.copy2(BIN, self.bin)
        self.env = {**os.environ, "NO_COLOR": "1"}
        if GUESTD.is_file():
            shutil.copy2(GUESTD, self.workdir / "clade-guestd")
            self.env["CLADE_GUESTD"] = str(self.workdir / "clade-guestd")
        self.args = list(args or [])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.admin_key = ""
        self.keys: List[str] = []

    def start(self, timeout: float = 90.0) -> "Server":
        cmd = [str(self.bin), "server", "--data-dir", str(self.data_dir), "--listen", f"127.0.0.1:{self.port}", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clade server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"clade server did not answer /healthz in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)
        self.admin_key = (self.data_dir / "admin.key").read_text().strip()
        self.keys.append(self.admin_key)
        return self

    def create_key(self, workspace: str) -> str:
        out = subprocess.run(
            [str(self.bin), "keys", "create", "--workspace", workspace, "--data-dir", str(self.data_dir)],
            capture_output=True, text=True, env=self.env, check=True, timeout=60,
        )
        key = out.stdout.strip().splitlines()[-1].strip()
        self.keys.append(key)
        return key

    def delete_all_sandboxes(self) -> None:
        for key in self.keys:
            with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                try:
                    for sandbox in http.get("/v1/sandboxes").json():
                        http.delete(f"/v1/sandboxes/{sandbox['id']}")
                except (httpx.HTTPError, ValueError, TypeError):
                    pass

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def leftover_pids(self) -> List[int]:
        """Processes (QEMUs) whose command line names this server's directory."""
        marker = str(self.workdir).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def teardown(self) -> None:
        try:
            self.delete_all_sandboxes()
        finally:
            self.stop()
            for pid in self.leftover_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for _ in range(5):
                shutil.rmtree(self.workdir, ignore_errors=True)
                if not self.workdir.exists():
                    break
                time.sleep(0.5)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


_servers: List[Server] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        for server in _servers:
            report.sections.append((f"clade server log ({server.log_path})", server.log_tail()))


@pytest.fixture(scope="session")
def requirements() -> None:
    reason = missing_requirement()
    if reason:
        skip_or_fail(reason)


@pytest.fixture(scope="session")
def server(requirements: None) -> Iterator[Server]:
    server = Server("main", args=["--standby-horizon", "30"]).start()
    _servers.append(server)
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


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.25, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


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
