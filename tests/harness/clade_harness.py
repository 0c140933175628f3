"""What the Python suites that drive a real `clade server` share: tests/sdk
(scripts/test-sdk), sdk/python/tests (scripts/test-sdk-python) and tests/mcp
(scripts/test-mcp). Each suite's conftest.py puts this directory on sys.path
and imports from here, so this module uses the standard library and pytest
alone: every suite's virtualenv has those, and nothing else in common.

A test that needs root, QEMU or the binary skips with the reason, but fails
when `CI` is set, so that a CI machine that lacks them cannot pass by
skipping.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CLADE_BIN", REPO / "target" / "release" / "clade"))
# The static guest agent of this checkout (what scripts/build makes), for
# when the binary under test is not in it (CLADE_BIN elsewhere).
GUESTD = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "clade-guestd"
# Where scripts/build-qemu puts Clade's own QEMU, which the server prefers.
OWN_QEMU = Path("/var/cache/clade/qemu")
# A dead or half-answering server shows as either.
_HTTP_ERRORS = (OSError, http.client.HTTPException)


def in_ci() -> bool:
    return os.environ.get("CI", "") not in ("", "false", "0")


def skip_or_fail(reason: str) -> None:
    """Skips the calling test, or fails it when `CI` is set."""
    if in_ci():
        pytest.fail(f"required for this test in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_requirement(suite: str, accept_own_qemu: bool = False) -> Optional[str]:
    """Why this machine cannot run the server with VMs, or None. `suite`
    opens the message about root; `accept_own_qemu` takes a build of
    scripts/build-qemu for QEMU when there is none on PATH."""
    if os.geteuid() != 0:
        return f"{suite} needs root (the server boots QEMU VMs)"
    qemu = os.environ.get("CLADE_QEMU", "qemu-system-x86_64")
    if shutil.which(qemu) is None and not (accept_own_qemu and OWN_QEMU.exists()):
        return f"{qemu} is not installed (scripts/install-host-deps)"
    if not BIN.is_file():
        return f"{BIN} does not exist (scripts/build, or point CLADE_BIN at a clade binary)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


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


class CladeServer:
    """One `clade server` process over a private temporary directory,
    `clade-<suite>-<name>-*`.

    With `copy_binaries` it runs copies of clade and clade-guestd kept in
    that directory, so that a rebuild while the suite runs cannot swap them
    mid-way; the data directory is then its subdirectory `data`, else the
    temporary directory itself. `teardown(keep_log=True)` copies the log
    into `artifacts`, when given."""

    # Started and not torn down yet: a failed test's report gets their logs.
    started: List["CladeServer"] = []

    def __init__(self, suite: str, name: str = "main", args: Optional[List[str]] = None,
                 env: Optional[Dict[str, str]] = None, copy_binaries: bool = False,
                 artifacts: Optional[Path] = None, tls: bool = False) -> None:
        self.name = name
        self.workdir = Path(tempfile.mkdtemp(prefix=f"clade-{suite}-{name}-"))
        self.data_dir = self.workdir / "data" if copy_binaries else self.workdir
        self.log_path = self.workdir / "server.log"
        self.artifacts = artifacts
        self.env = {**os.environ, "NO_COLOR": "1", **(env or {})}
        guestd = Path(self.env.get("CLADE_GUESTD", GUESTD))
        if copy_binaries:
            self.bin = self.workdir / "clade"
            shutil.copy2(BIN, self.bin)
            if guestd.is_file():
                shutil.copy2(guestd, self.workdir / "clade-guestd")
                self.env["CLADE_GUESTD"] = str(self.workdir / "clade-guestd")
        else:
            self.bin = BIN
            if "CLADE_GUESTD" not in self.env and guestd.is_file():
                self.env["CLADE_GUESTD"] = str(guestd)
        # With `tls` the server serves HTTPS with a CA of its own
        # (`--tls-self-signed`), which `ca_path` names once it has started.
        self.args = [*(args or []), *(["--tls-self-signed"] if tls else [])]
        # Every server gets its databases' PostgreSQL endpoint on a free
        # port of its own (the default port is one per machine).
        if not any(arg.startswith("--db-listen") for arg in self.args):
            self.args += ["--db-listen", "127.0.0.1:0"]
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.ca_path = self.data_dir / "tls" / "ca.pem" if tls else None
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.admin_key = ""
        self.keys: List[str] = []

    def start(self, timeout: float = 60.0) -> "CladeServer":
        """Starts the server (again, after stop or kill: the keys are kept)
        and waits for /healthz."""
        cmd = [str(self.bin), "server", "--data-dir", str(self.data_dir), "--listen", f"127.0.0.1:{self.port}", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True
            )
        if self not in CladeServer.started:
            CladeServer.started.append(self)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"clade server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"clade server did not answer /healthz in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)
        if not self.admin_key:
            self.admin_key = (self.data_dir / "admin.key").read_text().strip()
            self.keys.append(self.admin_key)
        return self

    def _tls_context(self) -> Optional[ssl.SSLContext]:
        """Trusts the server's own CA (and nothing else) when it serves TLS."""
        if self.ca_path is None or not self.ca_path.is_file():
            return None
        return ssl.create_default_context(cafile=str(self.ca_path))

    def healthy(self) -> bool:
        if self.ca_path is not None and not self.ca_path.is_file():
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2, context=self._tls_context()) as answer:
                status: int = answer.status
        except _HTTP_ERRORS:
            return False
        return status == 200

    def create_key(self, workspace: str) -> str:
        """A key of `workspace` (created if needed), made with `clade keys create`."""
        out = subprocess.run(
            [str(self.bin), "keys", "create", "--workspace", workspace, "--data-dir", str(self.data_dir)],
            capture_output=True, text=True, env=self.env, check=True, timeout=60,
        )
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
            with urllib.request.urlopen(request, timeout=timeout, context=self._tls_context()) as answer:
                status: int = answer.status
                text: str = answer.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode(errors="replace")
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def delete_all_sandboxes(self) -> None:
        """Removes every sandbox of every key this server knows (best effort)."""
        if not self.alive():
            return
        for key in self.keys:
            try:
                status, listed = self.api("GET", "/v1/sandboxes", key, timeout=30)
            except _HTTP_ERRORS:
                continue
            items = listed.get("items", []) if isinstance(listed, dict) else listed
            if status != 200 or not isinstance(items, list):
                continue
            for sandbox in items:
                try:
                    self.api("DELETE", f"/v1/sandboxes/{sandbox['id']}", key, timeout=60)
                except _HTTP_ERRORS:
                    pass

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then SIGKILL if it does not stop in time."""
        if self.proc is None or not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.alive():
            self.proc.kill()
            self.proc.wait(30)

    def vm_pids(self) -> List[int]:
        """Processes (QEMU, holders) started for VMs under this server's directory."""
        return processes_under(self.workdir, self.proc.pid if self.proc else None)

    def teardown(self, keep_log: bool = False) -> None:
        """Deletes the sandboxes, stops the server, kills VMs left behind (by
        pid: a server killed on purpose leaves its VMs running), keeps the
        log when asked, and removes the directory."""
        try:
            self.delete_all_sandboxes()
        finally:
            self.stop()
            kill_all(self.vm_pids())
            if keep_log and self.artifacts is not None and self.log_path.exists():
                self.artifacts.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.log_path, self.artifacts / f"{self.workdir.name}.log")
            # Mounts or files of VMs killed a moment ago may linger briefly.
            for _ in range(5):
                shutil.rmtree(self.workdir, ignore_errors=True)
                if not self.workdir.exists():
                    break
                time.sleep(0.5)
            if self in CladeServer.started:
                CladeServer.started.remove(self)

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)


def attach_server_logs(report: Any) -> None:
    """Adds the tail of each running server's log to a failed test's report
    (call from a pytest_runtest_makereport hookwrapper)."""
    if report.failed:
        for server in CladeServer.started:
            report.sections.append((f"clade server {server.name} ({server.log_path})", server.log_tail()))
