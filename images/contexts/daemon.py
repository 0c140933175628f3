#!/usr/bin/env python3
"""Clade code contexts: the guest-side daemon.

Notebook-style persistent kernels inside a sandbox VM. The Clade server
writes this file into a running guest and starts it detached:

    setsid -f python3 daemon.py --port 49999 --state-dir /run/clade/contexts

then speaks HTTP/1.1 with JSON bodies to it on 127.0.0.1:PORT:

    GET    /health                -> {"ok", "languages", "spare_ready"}
    POST   /warm                  -> {"spare_ready"} once the spare Python kernel is up
    POST   /contexts              {"language", "cwd"?, "env"?} -> 201 {"id", "language", "created_at"}
    GET    /contexts              -> [{"id", "language", "created_at", "cells", "alive"}]
    GET    /contexts/{id}         -> one of those
    DELETE /contexts/{id}         -> 204
    POST   /contexts/{id}/run     {"code", "timeout_ms"} -> 200 application/x-ndjson stream

A run streams one JSON object per line as output happens (stdout, stderr,
result, error) and always ends with {"type": "end", ...}; the connection is
closed after it. A client that closes the connection mid-cell aborts the
cell: Python's kernel is interrupted and bash's commands are signalled (the
context keeps its state, as after a timeout); a JavaScript cell can only be
stopped with its Node.js process, which ends the context. Languages: python (a Jupyter kernel through jupyter_client
and ipykernel), javascript and typescript (a Node.js child evaluating cells in
one persistent vm context), bash (one persistent interactive shell).

Standard library only at import time; jupyter_client and zmq are imported
lazily, for Python contexts. All timing uses time.monotonic, and nothing
depends on the host: the daemon keeps working when its VM is snapshotted and
restored, or forked.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import os
import queue
import re
import secrets
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ALL_LANGUAGES = ("python", "javascript", "typescript", "bash")

# Per cell: at most this much stdout+stderr text (UTF-8 bytes) and this much
# result data is sent; the rest is dropped and the end event says truncated.
MAX_TEXT_BYTES = 1 << 20
MAX_RESULT_BYTES = 8 << 20
# An error event's value and traceback are cut to these sizes.
MAX_ERROR_VALUE = 64 << 10
MAX_ERROR_TRACEBACK = 256 << 10
# Output a context produces between cells (background jobs, timers) is kept
# for the next cell, up to this much.
MAX_IDLE_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20

# How long a Python kernel has to answer an interrupt (after a timeout).
PY_INTERRUPT_GRACE = 5.0
# JavaScript enforces its own timeout; the daemon kills a runner that has not
# answered this long after the cell's timeout (a wedged event loop).
JS_KILL_GRACE = 5.0
# Bash after a timeout: SIGINT to the shell's process group, then SIGKILL to
# the commands in it after this long, then the shell itself after as long again.
BASH_ESCALATE_AFTER = 2.0
# A stalled HTTP client: a write blocked this long drops the client.
STREAM_WRITE_TIMEOUT = 60.0
KERNEL_START_TIMEOUT = 120.0
WARM_TIMEOUT = 120.0
SPARE_NICE = 10
# Seconds between a context taking the spare and the next spare's start.
SPARE_REPLACE_DELAY = 3.0
# What a primed spare has loaded (silently: no name is bound in the user's
# namespace); each import may be missing from an image.
PRIME_IMPORTS = """
import importlib
for _clade_module in ("numpy", "pandas", "matplotlib.pyplot"):
    try:
        importlib.import_module(_clade_module)
    except Exception:
        pass
del _clade_module, importlib
"""

TRUNCATION_NOTE = (
    "\n[output truncated: this cell's output went past the limit "
    "(1 MiB of stdout/stderr, 8 MiB of results); the rest is dropped]\n"
)

STATE_DIR = "."
# Where contexts start when no cwd is asked for (see default_cwd).
DEFAULT_CWD = "/"
# The environment the daemon started with (see environment_change).
START_ENVIRONMENT: dict = {}


def log(message: str) -> None:
    """Appends one line to STATE_DIR/daemon.log (the daemon runs detached)."""
    try:
        with open(os.path.join(STATE_DIR, "daemon.log"), "a", encoding="utf-8") as f:
            f.write(f"{rfc3339_now()} [{os.getpid()}] {message}\n")
    except OSError:
        pass


def default_cwd() -> str:
    """The daemon's working directory, which kernels inherit; but not the
    state directory (the server starts the daemon there), which holds the
    kernels' connection files with their keys: then the home directory."""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = STATE_DIR
    if cwd == STATE_DIR or cwd.startswith(STATE_DIR.rstrip(os.sep) + os.sep):
        home = os.path.expanduser("~")
        return home if os.path.isdir(home) else "/"
    return cwd


def rfc3339_now() -> str:
    now = datetime.now(timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[{len(text) - limit} more characters cut]"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group a child leads (a kernel, a runner, a
    shell: what it started goes too), or to the child alone without one."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def write_private_file(path: str, content: str) -> None:
    """Writes content to path atomically, readable by the daemon's user only."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content)
    os.replace(tmp, path)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def process_group_members(pgid: int) -> list[int]:
    """The pids whose process group is pgid (from /proc)."""
    members = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(name))
    return members


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc gives start times in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLOCK_TICKS)


def process_start_ticks(pid: int) -> int | None:
    """When pid started, in clock ticks since boot (/proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # pid (comm) state ppid pgrp ... starttime is the 22nd field.
        return int(stat[stat.rfind(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_running(pid: int) -> bool:
    """False once pid has exited (a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def ignores_sigint(pid: int) -> bool:
    """Whether pid ignores SIGINT (its SigIgn mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    except (OSError, ValueError):
        pass
    return False


def signal_quietly(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def renice_process(pid: int, value: int, idle: bool = False) -> None:
    """Sets the nice value of every thread of pid (Linux nice is per thread),
    and its policy: SCHED_IDLE when `idle` (it runs only when nothing else
    wants the CPU: a guest has one or two), else SCHED_OTHER."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except (OSError, AttributeError):
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:
            pass


# ---------------------------------------------------------------------------
# What this machine can run


class Languages:
    """Detects once which languages this machine can run, and caches it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._available: list[str] | None = None
        self.node: str | None = None
        self.bash: str | None = None

    def available(self) -> list[str]:
        with self._lock:
            if self._available is None:
                self._available = self._detect()
                log(f"languages: {', '.join(self._available) or 'none'}")
            return list(self._available)

    def _detect(self) -> list[str]:
        python = sys.executable or shutil.which("python3") or "python3"
        checks = {}
        try:
            checks["python"] = subprocess.Popen(
                [python, "-c", "import jupyter_client, ipykernel"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/",
            )
        except OSError:
            pass
        self.node = shutil.which("node")
        if self.node:
            try:
                checks["typescript"] = subprocess.Popen(
                    [
                        self.node,
                        "-e",
                        "process.exit(typeof require('node:module').stripTypeScriptTypes"
                        " === 'function' ? 0 : 3)",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd="/",
                )
            except OSError:
                self.node = None
        self.bash = shutil.which("bash")
        ok = {}
        for name, proc in checks.items():
            try:
                ok[name] = proc.wait(timeout=60) == 0
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                ok[name] = False
        found = []
        if ok.get("python"):
            found.append("python")
        if self.node:
            found.append("javascript")
            if ok.get("typescript"):
                found.append("typescript")
        if self.bash:
            found.append("bash")
        return found


LANGUAGES = Languages()


# ---------------------------------------------------------------------------
# One cell's output stream


class CellOutput:
    """Writes one run's NDJSON events to the HTTP client as they happen,
    enforcing the per-cell output limits, and tells the cell's loop when
    the client went away (it aborted the run)."""

    def __init__(self, wfile, connection=None) -> None:
        self._wfile = wfile
        self._connection = connection
        self.client_gone = False
        self.text_bytes = 0
        self.result_bytes = 0
        self.truncated = False
        self.errors = 0

    def _send(self, event: dict) -> None:
        if self.client_gone or self._wfile is None:
            return
        line = json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n"
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from a kernel
            data = line.encode("utf-8", "replace")
        try:
            self._wfile.write(data)
            self._wfile.flush()
        except (OSError, ValueError):
            self.client_gone = True

    def client_left(self) -> bool:
        """Whether the client closed its end: the request was read whole,
        so a readable socket can only be at its end (or reset)."""
        if self.client_gone or self._connection is None:
            return self.client_gone
        try:
            readable, _, _ = select.select([self._connection], [], [], 0)
            if readable and self._connection.recv(1, socket.MSG_PEEK) == b"":
                self.client_gone = True
        except (OSError, ValueError):
            self.client_gone = True
        return self.client_gone

    def _dropping(self) -> None:
        if not self.truncated:
            self.truncated = True
            self._send({"type": "stderr", "text": TRUNCATION_NOTE})

    def text(self, stream: str, text: str) -> None:
        if not text:
            return
        data = text.encode("utf-8", "replace")
        room = MAX_TEXT_BYTES - self.text_bytes
        if len(data) <= room:
            self.text_bytes += len(data)
            self._send({"type": stream, "text": text})
            return
        if room > 0:
            part = data[:room].decode("utf-8", "ignore")
            self.text_bytes = MAX_TEXT_BYTES
            if part:
                self._send({"type": stream, "text": part})
        self._dropping()

    def result(self, data: dict, is_main: bool) -> None:
        size = sum(len(value) for value in data.values())
        if self.result_bytes + size > MAX_RESULT_BYTES:
            self._dropping()
            return
        self.result_bytes += size
        self._send({"type": "result", "data": data, "is_main": is_main})

    def error(self, name: str, value: str, tb: str) -> None:
        self.errors += 1
        self._send(
            {
                "type": "error",
                "name": name,
                "value": cap(value, MAX_ERROR_VALUE),
                "traceback": cap(tb, MAX_ERROR_TRACEBACK),
            }
        )

    def end(self, event: dict) -> None:
        self._send(event)


class NullOutput(CellOutput):
    def __init__(self) -> None:
        super().__init__(None)


# ---------------------------------------------------------------------------
# Contexts


class ContextDead(Exception):
    """Raised by start-up code when a kernel/process is not usable."""


class Context:
    language = ""

    def __init__(self, cid: str) -> None:
        self.id = cid
        self.created_at = rfc3339_now()
        self.cells = 0
        self.lock = threading.Lock()  # serialises runs
        self.dead_reason: str | None = None
        self.deleted = False

    # Subclasses implement these.
    def alive(self) -> bool:
        raise NotImplementedError

    def exit_description(self) -> str:
        raise NotImplementedError

    def run(self, code: str, timeout_ms: int, out: CellOutput) -> dict:
        """Runs one cell, writing events to out. Returns extra fields for the
        end event: timed_out (bool) and, for bash, status."""
        raise NotImplementedError

    def kill(self) -> None:
        """Stops the kernel/process now (any thread; does not wait for the lock)."""
        raise NotImplementedError

    def release(self) -> None:
        """Frees what the run thread uses (called with self.lock held, or at exit)."""

    def info(self) -> dict:
        return {
            "id": self.id,
            "language": self.language,
            "created_at": self.created_at,
            "cells": self.cells,
            "alive": self.dead_reason is None and not self.deleted and self.alive(),
        }

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            log(f"{self.id} ({self.language}): kernel died: {reason}")

    kernel_name = "kernel"

    def died_value(self) -> str:
        if self.deleted:
            return "the context was deleted while the cell ran"
        return f"the {self.kernel_name} died ({self.exit_description()})"

    def delete(self) -> None:
        self.deleted = True
        self.kill()
        # A run in progress notices the death and returns quickly; what it
        # uses is freed once it has (later, if it is stuck writing to a slow
        # client: the process itself is already gone).
        if self.lock.acquire(timeout=15):
            try:
                self.release()
            finally:
                self.lock.release()
            return

        def release_later() -> None:
            with self.lock:
                self.release()

        threading.Thread(target=release_later, name=f"release-{self.id}", daemon=True).start()


# ---------------------------------------------------------------------------
# Python: a Jupyter kernel


class JupyterLoop:
    """One asyncio loop thread for jupyter_client's AsyncKernelManager: its
    synchronous wrappers would leave an event loop behind in every request
    thread, so every manager call goes through here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, coro, timeout: float | None = None):
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="jupyter-loop", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


JUPYTER = JupyterLoop()


class KernelChannels:
    """A minimal synchronous Jupyter client: shell (DEALER) and iopub (SUB)
    sockets and a Session for signing. jupyter_client's own clients are
    asyncio-backed in some versions; this is plain pyzmq."""

    def __init__(self, info: dict, key: bytes, signature_scheme: str) -> None:
        import zmq
        from jupyter_client.session import Session

        self._zmq = zmq
        self.session = Session(key=key, signature_scheme=signature_scheme)
        context = zmq.Context.instance()
        transport, ip = info.get("transport", "tcp"), info.get("ip", "127.0.0.1")

        def address(port: int) -> str:
            if transport == "tcp":
                return f"tcp://{ip}:{port}"
            return f"{transport}://{ip}-{port}"

        self.shell = context.socket(zmq.DEALER)
        self.shell.linger = 0
        self.shell.setsockopt(zmq.IDENTITY, self.session.bsession)
        self.shell.connect(address(info["shell_port"]))
        self.iopub = context.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(address(info["iopub_port"]))

    def send(self, msg_type: str, content: dict) -> str:
        msg = self.session.send(self.shell, msg_type, content)
        return msg["header"]["msg_id"]

    def _recv(self, sock, timeout: float) -> dict | None:
        if not sock.poll(int(timeout * 1000)):
            return None
        frames = sock.recv_multipart()
        _, parts = self.session.feed_identities(frames)
        return self.session.deserialize(parts)

    def iopub_msg(self, timeout: float) -> dict | None:
        return self._recv(self.iopub, timeout)

    def shell_msg(self, timeout: float) -> dict | None:
        return self._recv(self.shell, timeout)

    def drain(self) -> None:
        while self._recv(self.iopub, 0) is not None:
            pass
        while self._recv(self.shell, 0) is not None:
            pass

    def close(self) -> None:
        for sock in (self.shell, self.iopub):
            try:
                sock.close(linger=0)
            except Exception:
                pass


def kernel_environment() -> dict:
    env = dict(os.environ)
    if "MPLBACKEND" not in env:
        import importlib.util

        if importlib.util.find_spec("matplotlib_inline") is not None:
            # Figures come back as image/png (plt.show() and Figure values).
            env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # debugpy's warning about frozen modules, printed at every kernel start.
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


_kernel_specs = None


def python3_kernel_specs():
    """A KernelSpecManager that finds an installed "python3" kernel spec as
    jupyter_client does, but makes the built-in one (ipykernel with this
    interpreter) itself: jupyter_client would import ipykernel, IPython and
    debugpy into the daemon for it (some 25 MB and half a second)."""
    from jupyter_client.kernelspec import KernelSpecManager

    class Specs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            for directory in self.kernel_dirs:
                resource_dir = os.path.join(directory, kernel_name)
                if os.path.isfile(os.path.join(resource_dir, "kernel.json")):
                    return self.kernel_spec_class.from_resource_dir(resource_dir)
            return self.kernel_spec_class(
                resource_dir="",
                argv=[
                    sys.executable or "python3",
                    "-m",
                    "ipykernel_launcher",
                    "-f",
                    "{connection_file}",
                    # Each context's history in its own memory: the default
                    # SQLite file in ~/.ipython is written (and synced) after
                    # every cell, and is shared, and locked, by every kernel.
                    "--HistoryManager.hist_file=:memory:",
                ],
                display_name="Python 3 (ipykernel)",
                language="python",
                interrupt_mode="signal",
                metadata={"debugger": True},
            )

    from jupyter_core.paths import jupyter_path

    # Explicit: the default would import IPython for ~/.ipython/kernels.
    return Specs(kernel_dirs=jupyter_path("kernels"))


class PythonKernel:
    """A started, ready ipykernel: its manager, process and channels."""

    def __init__(self, km, popen, channels: KernelChannels, connection_file: str) -> None:
        self.km = km
        self.popen = popen
        self.channels = channels
        self.connection_file = connection_file
        self.niced = False

    @classmethod
    def start(cls, nice: bool) -> "PythonKernel":
        import zmq.asyncio
        from jupyter_client import AsyncKernelManager

        global _kernel_specs
        if _kernel_specs is None:
            _kernel_specs = python3_kernel_specs()
        connection_file = os.path.join(STATE_DIR, f"kernel-{secrets.token_hex(6)}.json")
        env = kernel_environment()
        stderr_log = open(os.path.join(STATE_DIR, "kernels.log"), "ab")

        async def launch():
            km = AsyncKernelManager(
                kernel_name="python3",
                kernel_spec_manager=_kernel_specs,
                context=zmq.asyncio.Context.instance(),
            )
            km.connection_file = connection_file
            await km.start_kernel(
                env=env, cwd=DEFAULT_CWD, stdout=subprocess.DEVNULL, stderr=stderr_log
            )
            return km

        try:
            km = JUPYTER.run(launch(), timeout=60)
        finally:
            stderr_log.close()
        popen = getattr(getattr(km, "provisioner", None), "process", None) or getattr(km, "kernel", None)
        kernel = None
        try:
            if popen is None:
                raise ContextDead("jupyter_client started no kernel process")
            niced = False
            if nice:
                renice_process(popen.pid, os.getpriority(os.PRIO_PROCESS, 0) + SPARE_NICE, idle=True)
                niced = True
            info = km.get_connection_info()
            channels = KernelChannels(info, km.session.key, km.session.signature_scheme)
            kernel = cls(km, popen, channels, connection_file)
            kernel.niced = niced
            kernel.wait_ready(KERNEL_START_TIMEOUT)
            return kernel
        except BaseException:
            if kernel is not None:
                kernel.close()
            else:
                try:
                    JUPYTER.run(km.shutdown_kernel(now=True), timeout=15)
                except Exception:
                    pass
            raise

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Waits until the kernel answers on shell and its iopub messages
        reach us (a SUB socket misses what is published before it joins)."""
        deadline = time.monotonic() + timeout

        def check() -> None:
            if not self.alive():
                raise ContextDead(f"the kernel exited while starting ({describe_exit(self.popen.returncode)})")
            if time.monotonic() > deadline:
                raise ContextDead(f"the kernel did not start within {timeout:.0f} s")

        replied = False
        while not replied:
            check()
            msg_id = self.channels.send("kernel_info_request", {})
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                msg = self.channels.shell_msg(0.1)
                if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
                    replied = True
                    break
                if msg is None and not self.alive():
                    break
        # Each request makes the kernel publish busy/idle; once one of those
        # arrives, the subscription is up. Probe often: a miss costs a window.
        probes = set()
        seen = False
        while not seen:
            check()
            probes.add(self.channels.send("kernel_info_request", {}))
            until = time.monotonic() + 0.1
            while time.monotonic() < until:
                msg = self.channels.iopub_msg(0.02)
                if msg is not None and msg["parent_header"].get("msg_id") in probes:
                    seen = True
                    break
        time.sleep(0.05)  # the probes' last messages
        self.channels.drain()

    def unnice(self) -> None:
        if self.niced:
            renice_process(self.popen.pid, os.getpriority(os.PRIO_PROCESS, 0))
            self.niced = False

    def settle(self, cwd: str | None, env: dict) -> None:
        """Moves the kernel to its context's directory and environment (a
        spare was started before either was known)."""
        steps = []
        if cwd is not None:
            steps.append(f"__import__('os').chdir({cwd!r})")
        if env:
            steps.append(f"__import__('os').environ.update({env!r})")
        if not steps:
            return
        msg_id = self.channels.send(
            "execute_request",
            {
                "code": "; ".join(steps),
                "silent": True,
                "store_history": False,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": False,
            },
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = self.channels.shell_msg(0.1)
            if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
                if msg["content"].get("status") != "ok":
                    raise ContextDead(f"cannot move the kernel to {cwd} with its environment")
                return
            if msg is None and not self.alive():
                break
        raise ContextDead("the kernel did not answer")

    def prime(self, code: str, silent: bool, timeout: float) -> bool:
        """Runs `code` outside any context (its output dropped), so that what
        a first cell would load or initialise is in memory already; whether
        it finished in time."""
        msg_id = self.channels.send(
            "execute_request",
            {
                "code": code,
                "silent": silent,
                "store_history": False,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": False,
            },
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            msg = self.channels.shell_msg(0.1)
            if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
                time.sleep(0.05)  # its last iopub messages
                self.channels.drain()
                return True
        return False

    def interrupt(self) -> None:
        try:
            JUPYTER.run(self.km.interrupt_kernel(), timeout=5)
        except Exception as e:  # fall back to the signal itself
            log(f"interrupt_kernel failed ({e!r}); sending SIGINT")
            try:
                os.killpg(self.popen.pid, signal.SIGINT)
            except OSError:
                pass

    def kill(self) -> None:
        kill_group(self.popen)

    def close(self) -> None:
        """Stops the kernel (if still running), reaps it, frees its files."""
        self.channels.close()
        try:
            JUPYTER.run(self.km.shutdown_kernel(now=True), timeout=15)
        except Exception as e:
            log(f"shutdown_kernel failed: {e!r}")
        self.kill()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        remove_quietly(self.connection_file)


class SparePool:
    """Keeps one started, idle Python kernel ready (a VM snapshot taken after
    the daemon started holds it). Never starts two at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: PythonKernel | None = None
        self._starting = False
        self._attempts = 0
        self.last_error: str | None = None

    def ready(self) -> bool:
        with self._cond:
            return self._ready is not None

    def ensure(self) -> None:
        with self._cond:
            self._ensure_locked()

    def _ensure_locked(self) -> None:
        if self._ready is None and not self._starting:
            self._starting = True
            threading.Thread(target=self._start, name="spare-kernel", daemon=True).start()

    def _ensure_later(self) -> None:
        """The next spare, once the context that took this one has had its
        first cells: a kernel starting beside them would take the guest's
        CPU from them (the spare runs at idle priority, but the daemon's
        part of its start does not)."""

        def later() -> None:
            time.sleep(SPARE_REPLACE_DELAY)
            self.ensure()

        threading.Thread(target=later, name="spare-later", daemon=True).start()

    def _start(self) -> None:
        began = time.monotonic()
        kernel, error = None, None
        try:
            kernel = PythonKernel.start(nice=os.geteuid() == 0)
        except Exception as e:
            error = str(e) or repr(e)
            log(f"spare kernel failed to start: {error}")
        else:
            log(f"spare kernel ready in {time.monotonic() - began:.2f} s (pid {kernel.popen.pid})")
        with self._cond:
            self._starting = False
            self._attempts += 1
            self._ready = kernel
            self.last_error = error
            self._cond.notify_all()

    def take(self, timeout: float) -> PythonKernel:
        """The ready kernel (then a new spare starts), or waits for the one
        starting. Raises ContextDead when that start fails."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._ready is not None:
                    kernel, self._ready = self._ready, None
                    if kernel.alive():
                        self._ensure_later()
                        return kernel
                    threading.Thread(target=kernel.close, daemon=True).start()
                self._ensure_locked()
                attempt = self._attempts
                while self._attempts == attempt:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ContextDead("the Python kernel did not start in time")
                    self._cond.wait(left)
                if self._ready is None:
                    raise ContextDead(f"the Python kernel did not start: {self.last_error}")

    def warm(self, timeout: float) -> bool:
        """Waits for the spare and primes it (once): the data stack imported
        and a cell run, so that a template's snapshot holds a kernel whose
        first cell and first chart load nothing."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._ensure_locked()
            while self._ready is None:
                if not self._starting:
                    return False  # the attempt failed
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            kernel = self._ready
            if getattr(kernel, "primed", False):
                return True
            kernel.primed = True
        left = max(1.0, deadline - time.monotonic())
        kernel.prime(PRIME_IMPORTS, silent=True, timeout=left)
        kernel.prime("1 + 1", silent=False, timeout=max(1.0, deadline - time.monotonic()))
        return True

    def shutdown(self) -> None:
        with self._cond:
            kernel, self._ready = self._ready, None
        if kernel is not None:
            kernel.kill()


SPARE = SparePool()


def mime_bundle(data: dict | None) -> dict:
    bundle = {}
    for mime, value in (data or {}).items():
        bundle[mime] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return bundle


class PythonContext(Context):
    language = "python"
    kernel_name = "Python kernel"

    def __init__(self, cid: str, kernel: PythonKernel) -> None:
        super().__init__(cid)
        self.kernel = kernel

    def alive(self) -> bool:
        return self.kernel.alive()

    def exit_description(self) -> str:
        return describe_exit(self.kernel.popen.poll())

    def kill(self) -> None:
        self.kernel.kill()

    def release(self) -> None:
        self.kernel.close()

    def run(self, code: str, timeout_ms: int, out: CellOutput) -> dict:
        channels = self.kernel.channels
        channels.drain()
        msg_id = channels.send(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                # Runs are serialised, so there is never a queued cell to
                # abort; and with it, a cell sent just after one that raised
                # can land in ipykernel's abort window and be skipped.
                "stop_on_error": False,
            },
        )
        start = time.monotonic()
        deadline = start + timeout_ms / 1000 if timeout_ms > 0 else None
        timed_out = False
        give_up_at = None
        interrupt_tb = ""
        died = False
        aborted = False

        def handle(msg: dict) -> bool:
            """Returns True at the cell's end (status idle)."""
            nonlocal interrupt_tb
            if msg["parent_header"].get("msg_id") != msg_id:
                return False
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.text("stderr" if content.get("name") == "stderr" else "stdout", content.get("text", ""))
            elif kind in ("execute_result", "display_data", "update_display_data"):
                out.result(mime_bundle(content.get("data")), kind == "execute_result")
            elif kind == "error":
                tb = strip_ansi("\n".join(content.get("traceback") or []))
                if timed_out and content.get("ename") == "KeyboardInterrupt":
                    interrupt_tb = tb
                else:
                    out.error(
                        str(content.get("ename", "Error")), strip_ansi(str(content.get("evalue", ""))), tb
                    )
            elif kind == "status" and content.get("execution_state") == "idle":
                return True
            return False

        while True:
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline:
                timed_out = True
                self.kernel.interrupt()
                give_up_at = time.monotonic() + PY_INTERRUPT_GRACE
            elif not aborted and not timed_out and out.client_left():
                aborted = True
                self.kernel.interrupt()
                give_up_at = time.monotonic() + PY_INTERRUPT_GRACE
            if give_up_at is not None and now >= give_up_at:
                break  # the kernel did not stop; it stays busy, with its state
            msg = channels.iopub_msg(0.05)
            if msg is None:
                if not self.kernel.alive():
                    died = True
                    break
                continue
            if handle(msg):
                break
        if died:
            # What it published before it died.
            while (msg := channels.iopub_msg(0.1)) is not None:
                handle(msg)
        elif not timed_out:
            # The reply precedes idle; it says whether the cell ran at all.
            until = time.monotonic() + 0.5
            while time.monotonic() < until:
                reply = channels.shell_msg(0.05)
                if reply is not None and reply["parent_header"].get("msg_id") == msg_id:
                    if reply["content"].get("status") == "aborted":
                        out.error("Aborted", "the kernel aborted the cell without running it", "")
                    break
        if timed_out:
            if not interrupt_tb and not died and give_up_at is not None and time.monotonic() >= give_up_at:
                interrupt_tb = "the kernel did not stop within a few seconds of the interrupt; it may still be busy"
            out.error("TimeoutError", f"the cell ran past {timeout_ms} ms and was interrupted", interrupt_tb)
        if died:
            self.mark_dead(self.exit_description())
            out.error("KernelDied", self.died_value(), "")
        return {"timed_out": timed_out}


# ---------------------------------------------------------------------------
# Child processes: bash and Node.js


class ChildContext(Context):
    """A context backed by one child process in its own session and process
    group, whose pipes one reader thread turns into a queue of items:
    ("raw", stream, bytes), ("event", dict) and ("eof",)."""

    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        self.proc: subprocess.Popen | None = None
        self.items: queue.Queue = queue.Queue()
        self.running = False
        self._idle_bytes = 0
        self._idle_lock = threading.Lock()
        # Closing _wake_w stops the reader, which owns (and closes) the read
        # ends: a pipe another process still holds open never reaches EOF.
        self._wake_r, self._wake_w = os.pipe()
        self._released = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_description(self) -> str:
        if self.proc is None:
            return "not started"
        code = self.proc.poll()
        if code is None:
            try:
                code = self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                return "it stopped answering"
        return describe_exit(code)

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.proc is not None:
            self.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
        os.close(self._wake_w)

    def spawn(self, args: list[str], cwd: str | None, env: dict, stdin, pass_fds=(), events_fd: int | None = None) -> None:
        """Starts the child in its own session, with `env` over the daemon's
        environment, stdout and stderr on pipes the reader thread owns (and
        events_fd, which it then owns too)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=stdin,
                stdout=out_w,
                stderr=err_w,
                pass_fds=pass_fds,
                cwd=cwd or DEFAULT_CWD,
                env={**os.environ, **env} if env else None,
                start_new_session=True,
                bufsize=0,
            )
        except BaseException:
            for fd in (out_r, err_r, self._wake_r, self._wake_w):
                os.close(fd)
            self._released = True
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        threading.Thread(
            target=self._read,
            args=({out_r: "stdout", err_r: "stderr"}, events_fd),
            name=f"reader-{self.id}",
            daemon=True,
        ).start()

    def _queue(self, item: tuple, size: int) -> None:
        """Queues output; between cells only MAX_IDLE_BYTES are kept."""
        if not self.running:
            with self._idle_lock:
                if self._idle_bytes + size > MAX_IDLE_BYTES:
                    return
                self._idle_bytes += size
        self.items.put(item)

    def reset_idle(self) -> None:
        with self._idle_lock:
            self._idle_bytes = 0

    def _read(self, raw: dict[int, str], events_fd: int | None) -> None:
        selector = selectors.DefaultSelector()
        for fd in raw:
            selector.register(fd, selectors.EVENT_READ)
        if events_fd is not None:
            selector.register(events_fd, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        pending = b""

        def drain_raw() -> None:
            # Output of the cell's subprocesses that is already in the pipes
            # belongs before the runner's "done".
            for fd, stream in raw.items():
                if fd not in selector.get_map():
                    continue
                while select.select([fd], [], [], 0)[0]:
                    data = os.read(fd, 65536)
                    if not data:
                        break
                    self._queue(("raw", stream, data), len(data))

        try:
            while len(selector.get_map()) > 1:
                for key, _ in selector.select():
                    fd = key.fd
                    if fd == self._wake_r:
                        return  # released
                    try:
                        data = os.read(fd, 65536)
                    except OSError:
                        data = b""
                    if not data:
                        selector.unregister(fd)
                        continue
                    if fd != events_fd:
                        self._queue(("raw", raw[fd], data), len(data))
                        continue
                    pending += data
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if not line.strip():
                            continue
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue
                        if event.get("type") == "done":
                            drain_raw()
                        self._queue(("event", event), len(line))
        except Exception as e:
            log(f"{self.id}: reader failed: {e!r}")
        finally:
            selector.close()
            for fd in [*raw, events_fd, self._wake_r]:
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.items.put(("eof",))

    def next_item(self, timeout: float):
        try:
            return self.items.get(timeout=timeout)
        except queue.Empty:
            return None


class BashContext(ChildContext):
    """One interactive bash (`-i --noediting`, no prompts, no history) fed
    through stdin. Each cell is written to a file and sourced, with stdin
    from /dev/null, followed by a line that prints a per-cell sentinel and
    the cell's status to stdout and to stderr. Interactive, so that SIGINT
    to its process group stops the running cell (loops included) while the
    shell survives; sourced, so that incomplete syntax cannot swallow the
    sentinel."""

    language = "bash"
    kernel_name = "bash shell"

    def __init__(self, cid: str, cwd: str | None, env: dict) -> None:
        super().__init__(cid)
        self.cell_file = os.path.join(STATE_DIR, f"cell-{cid}.sh")
        self.carry = {"stdout": b"", "stderr": b""}
        self.spawn([LANGUAGES.bash or "bash", "--noprofile", "--norc", "--noediting", "-i"], cwd, env, subprocess.PIPE)
        setup = (
            "PS1=''; PS2=''; PS0=''; PS4='+ '; unset PROMPT_COMMAND HISTFILE MAILCHECK; "
            "set +H +o history; __clade_ret() { return \"$1\"; }\n"
        )
        result = self._execute(setup, 0, NullOutput(), deadline_s=30.0)
        if result.get("status") is None:
            self.kill()
            self.release()
            raise ContextDead(f"bash did not start ({self.exit_description()})")
        self.carry = {"stdout": b"", "stderr": b""}

    def run(self, code: str, timeout_ms: int, out: CellOutput) -> dict:
        write_private_file(self.cell_file, code if code.endswith("\n") else code + "\n")
        source = f"source {shlex_quote(self.cell_file)} </dev/null\n"
        return self._execute(source, timeout_ms, out)

    def release(self) -> None:
        super().release()
        remove_quietly(self.cell_file)

    def _execute(self, command: str, timeout_ms: int, out: CellOutput, deadline_s: float | None = None) -> dict:
        nonce = secrets.token_hex(16)
        # printf joins two arguments, so the sentinel never appears in an
        # xtrace (set -x) line of the command that prints it.
        markers = {
            "stdout": f"__clade_{nonce}_o ".encode(),
            "stderr": f"__clade_{nonce}_e\n".encode(),
        }
        sentinel = (
            f"__clade_st=$?; builtin printf '%s%s %d\\n' __clade_ {nonce}_o \"$__clade_st\"; "
            f"builtin printf '%s%s\\n' __clade_ {nonce}_e >&2; __clade_ret \"$__clade_st\"\n"
        )
        buffers = dict(self.carry)
        decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in buffers}
        done = {"stdout": False, "stderr": False}
        status: int | None = None

        def emit(stream: str, data: bytes, final: bool = False) -> None:
            text = decoders[stream].decode(data, final)
            if text:
                out.text(stream, text)

        def scan(stream: str) -> None:
            nonlocal status
            if done[stream]:
                return
            data, marker = buffers[stream], markers[stream]
            at = data.find(marker)
            if at < 0:
                keep = partial_suffix(data, marker)
                emit(stream, data[: len(data) - keep])
                buffers[stream] = data[len(data) - keep :]
                return
            if stream == "stdout":
                newline = data.find(b"\n", at + len(marker))
                if newline < 0:  # the status is still on its way
                    emit(stream, data[:at])
                    buffers[stream] = data[at:]
                    return
                try:
                    status = int(data[at + len(marker) : newline])
                except ValueError:
                    status = 1
                rest = data[newline + 1 :]
            else:
                rest = data[at + len(marker) :]
            emit(stream, data[:at], final=True)
            buffers[stream] = rest
            done[stream] = True

        self.reset_idle()
        self.running = True
        start = time.monotonic()
        cell_began = boot_ticks()
        if deadline_s is not None:
            deadline = start + deadline_s
        else:
            deadline = start + timeout_ms / 1000 if timeout_ms > 0 else None
        timed_out = False
        stage = 0  # 1: SIGINT sent, 2: commands killed
        next_stage = None
        died = False
        try:
            try:
                data = memoryview((command + sentinel).encode("utf-8", "surrogateescape"))
                while data:
                    data = data[self.proc.stdin.write(data) :]
            except OSError:
                died = True
            for stream in buffers:
                scan(stream)
            while not died and not (done["stdout"] and done["stderr"]):
                now = time.monotonic()
                if stage == 0 and ((deadline is not None and now >= deadline) or out.client_left()):
                    timed_out = deadline is not None and now >= deadline
                    stage, next_stage = 1, now + BASH_ESCALATE_AFTER
                    self._signal_group(signal.SIGINT, include_shell=True)
                elif stage == 1 and now >= next_stage:
                    stage, next_stage = 2, now + BASH_ESCALATE_AFTER
                    self._signal_group(signal.SIGKILL, include_shell=False)
                elif stage == 2 and now >= next_stage:
                    self.kill()
                    died = True
                    break
                item = self.next_item(0.05)
                if item is None:
                    continue
                if item[0] == "eof":
                    died = True
                    break
                _, stream, data = item
                buffers[stream] += data
                scan(stream)
        finally:
            self.running = False
        if stage and not died:
            self._stop_missed_commands(cell_began)
        if died:
            for stream in buffers:
                if not done[stream]:
                    emit(stream, buffers[stream], final=True)
            buffers = {"stdout": b"", "stderr": b""}
        self.carry = buffers
        if timed_out:
            out.error("TimeoutError", f"the cell ran past {timeout_ms} ms and was interrupted", "")
        if died:
            self.mark_dead(self.exit_description())
            out.error("KernelDied", self.died_value(), "")
            code = self.proc.poll()
            if code is not None:
                status = code if code >= 0 else 128 - code
            return {"timed_out": timed_out, "status": status}
        return {"timed_out": timed_out, "status": status}

    def _stop_missed_commands(self, cell_began: int) -> None:
        """Stops what an interrupted cell left running. bash abandons a cell
        when the SIGINT lands while it is between two commands (or between
        forking a command and waiting for it), and the command it was
        starting never gets the signal (not born yet, or still running
        bash's own handler): that command runs on with the next cell
        (`echo x; sleep 600` interrupted after its first line). So every
        process of the shell's group that the cell started and that does
        not ignore SIGINT (background jobs do, in a shell without job
        control) gets the SIGINT now, and SIGKILL if it outlives the grace."""
        pgid = self.proc.pid

        def left_running() -> list[int]:
            return [
                pid
                for pid in process_group_members(pgid)
                if pid != pgid
                and process_running(pid)
                and (process_start_ticks(pid) or 0) >= cell_began
                and not ignores_sigint(pid)
            ]

        left = left_running()
        for pid in left:
            signal_quietly(pid, signal.SIGINT)
        grace = time.monotonic() + BASH_ESCALATE_AFTER
        while left and time.monotonic() < grace:
            time.sleep(0.02)
            left = [pid for pid in left_running() if pid in left]
        for pid in left:
            signal_quietly(pid, signal.SIGKILL)

    def _signal_group(self, signum: int, include_shell: bool) -> None:
        pgid = self.proc.pid
        if include_shell:
            try:
                os.killpg(pgid, signum)
            except OSError:
                pass
            return
        for pid in process_group_members(pgid):
            if pid != pgid:
                signal_quietly(pid, signum)


def partial_suffix(data: bytes, marker: bytes) -> int:
    """Length of the longest end of data that begins marker."""
    for size in range(min(len(data), len(marker) - 1), 0, -1):
        if marker.startswith(data[-size:]):
            return size
    return 0


def shlex_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


# The Node.js side: reads requests ({"id", "cell", "code", "timeout_ms"}, one
# JSON per line) on the fd in argv[2], writes events (one JSON per line) on
# the fd in argv[3]. Its own stdout/stderr go to the daemon as raw output (of
# subprocesses); process.stdout/stderr.write and console become events.
JS_RUNNER = r"""'use strict';
const vm = require('vm');
const util = require('util');
const fs = require('fs');
const net = require('net');
const path = require('path');
const url = require('url');
const Module = require('module');
const { StringDecoder } = require('string_decoder');

const REQUEST_FD = Number(process.argv[2]);
const EVENT_FD = Number(process.argv[3]);
const TYPESCRIPT = process.argv[4] === 'typescript';
const TIMED_OUT = Symbol('timed out');
let current = null;

function writeAll(buffer) {
  let offset = 0;
  while (offset < buffer.length) {
    try {
      offset += fs.writeSync(EVENT_FD, buffer, offset, buffer.length - offset);
    } catch (e) {
      if (e && e.code === 'EAGAIN') {
        Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 5);
        continue;
      }
      process.reallyExit(70);
    }
  }
}

function send(event) {
  let line;
  try {
    line = JSON.stringify(event);
  } catch (e) {
    line = JSON.stringify({ type: 'stderr', id: event.id, text: String(e) + '\n' });
  }
  writeAll(Buffer.from(line + '\n', 'utf8'));
}

function capture(stream, type) {
  const decoder = new StringDecoder('utf8');
  stream.write = function write(chunk, encoding, callback) {
    if (typeof encoding === 'function') {
      callback = encoding;
      encoding = undefined;
    }
    let text;
    if (typeof chunk === 'string') {
      text = encoding && !/^utf-?8$/i.test(encoding) ? Buffer.from(chunk, encoding).toString('utf8') : chunk;
    } else if (ArrayBuffer.isView(chunk)) {
      text = decoder.write(Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength));
    } else {
      text = String(chunk);
    }
    if (text) send({ type, id: current, text });
    if (typeof callback === 'function') process.nextTick(callback);
    return true;
  };
}
capture(process.stdout, 'stdout');
capture(process.stderr, 'stderr');

// The experimental features the runner itself uses would warn in cells.
const emitWarning = process.emitWarning;
process.emitWarning = function (warning, ...rest) {
  const text = String(warning && warning.message !== undefined ? warning.message : warning);
  if (/USE_MAIN_CONTEXT_DEFAULT_LOADER|VM Modules|stripTypeScriptTypes|Type Stripping|TypeScript/i.test(text)) return;
  return emitWarning.call(process, warning, ...rest);
};

function describe(value) {
  if (value !== null && typeof value === 'object' && typeof value.stack === 'string') return value.stack;
  try {
    return util.inspect(value);
  } catch (e) {
    return String(value);
  }
}
process.on('uncaughtException', (e) => {
  send({ type: 'stderr', id: current, text: 'Uncaught ' + describe(e) + '\n' });
});
process.on('unhandledRejection', (e) => {
  send({ type: 'stderr', id: current, text: 'Unhandled promise rejection: ' + describe(e) + '\n' });
});

// The context: fresh JavaScript builtins plus Node's globals, a require
// rooted at the working directory, and console going to the event stream.
const cwd = process.cwd();
const contextFile = path.join(cwd, '[context]');
const userRequire = Module.createRequire(contextFile);
const sandbox = {};
const builtins = new Set(vm.runInNewContext('Object.getOwnPropertyNames(globalThis)'));
for (const name of Object.getOwnPropertyNames(globalThis)) {
  if (builtins.has(name) || name === 'global' || name === 'globalThis') continue;
  try {
    Object.defineProperty(sandbox, name, Object.getOwnPropertyDescriptor(globalThis, name));
  } catch (e) {}
}
const userModule = { exports: {}, id: '.', filename: contextFile, loaded: true, require: userRequire, paths: Module._nodeModulePaths ? Module._nodeModulePaths(cwd) : [] };
Object.assign(sandbox, {
  console,
  require: userRequire,
  module: userModule,
  exports: userModule.exports,
  __filename: contextFile,
  __dirname: cwd,
});
const context = vm.createContext(sandbox, { name: 'clade' });
vm.runInContext('globalThis.global = globalThis;', context);

// Node >= 20.12 / 21.7 resolves import() in a vm context like the main
// context (relative to the working directory); older ones call us back (with
// --experimental-vm-modules).
function importFromCwd(specifier) {
  let target = specifier;
  if (!/^[a-zA-Z][a-zA-Z0-9+.-]*:/.test(specifier)) {
    try {
      target = url.pathToFileURL(userRequire.resolve(specifier)).href;
    } catch (e) {
      if (specifier.startsWith('.') || specifier.startsWith('/')) target = url.pathToFileURL(path.resolve(cwd, specifier)).href;
    }
  }
  return import(target);
}

// Top-level await, as Node's REPL does it (internal; absent -> no TLA).
let processTopLevelAwait = null;
try {
  processTopLevelAwait = require('internal/repl/await').processTopLevelAwait;
} catch (e) {}

function compile(code, filename) {
  const options = { filename, importModuleDynamically: (vm.constants && vm.constants.USE_MAIN_CONTEXT_DEFAULT_LOADER) || importFromCwd };
  // Like the REPL: `{a: 1}` is an object, not a block.
  if (/^\s*\{/.test(code) && !/;\s*$/.test(code)) {
    try {
      return { script: new vm.Script('(' + code + '\n)', options), wrapped: false };
    } catch (e) {}
  }
  try {
    return { script: new vm.Script(code, options), wrapped: false };
  } catch (e) {
    if (processTopLevelAwait && e && e.name === 'SyntaxError' && /\bawait\b/.test(code)) {
      let transformed = null;
      try {
        transformed = processTopLevelAwait(code);
      } catch (_) {}
      if (transformed) return { script: new vm.Script(transformed, options), wrapped: true };
    }
    throw e;
  }
}

function toJavaScript(code) {
  const strip = Module.stripTypeScriptTypes;
  try {
    return strip(code, { mode: 'strip' });
  } catch (e) {
    if (e && e.code === 'ERR_UNSUPPORTED_TYPESCRIPT_SYNTAX') return strip(code, { mode: 'transform' });
    throw e;
  }
}

function within(promise, ms) {
  if (!ms) return Promise.resolve(promise);
  let timer;
  const expiry = new Promise((_, reject) => {
    timer = setTimeout(() => reject(TIMED_OUT), ms);
  });
  return Promise.race([Promise.resolve(promise), expiry]).finally(() => clearTimeout(timer));
}

function cleanStack(stack) {
  const lines = String(stack).split('\n');
  // The runner's own frames (vm, type stripping, this file) are noise.
  const cut = lines.findIndex((line) => /^\s+at /.test(line) && (line.includes('node:vm') || line.includes(__filename)));
  return (cut >= 0 ? lines.slice(0, cut) : lines)
    .filter((line) => !(/^\s+at /.test(line) && line.includes('node:internal/modules/typescript')))
    .join('\n');
}

function errorEvent(id, e) {
  if (e !== null && typeof e === 'object') {
    let name = 'Error', message = '', stack = '';
    try { name = String(e.name ?? 'Error'); } catch (_) {}
    try { message = String(e.message ?? ''); } catch (_) {}
    try { stack = typeof e.stack === 'string' ? cleanStack(e.stack) : ''; } catch (_) {}
    if (!stack) stack = 'Uncaught ' + describe(e);
    return { type: 'error', id, name, value: message, traceback: stack };
  }
  const text = describe(e);
  return { type: 'error', id, name: 'Error', value: text, traceback: 'Uncaught ' + text };
}

function isThenable(value) {
  try {
    return value !== null && (typeof value === 'object' || typeof value === 'function') && typeof value.then === 'function';
  } catch (e) {
    return false;
  }
}

async function runCell(request) {
  const id = request.id;
  current = id;
  const started = performance.now();
  const limit = request.timeout_ms > 0 ? request.timeout_ms : 0;
  try {
    let code = request.code;
    if (TYPESCRIPT) code = toJavaScript(code);
    const { script, wrapped } = compile(code, `<cell ${request.cell}>`);
    const options = { displayErrors: true };
    if (limit) options.timeout = limit;
    let value = script.runInContext(context, options);
    if (isThenable(value)) {
      const left = limit ? Math.max(1, Math.round(limit - (performance.now() - started))) : 0;
      value = await within(value, left);
      if (wrapped) value = value === null || value === undefined ? undefined : value.value;
    }
    if (value !== undefined) send({ type: 'result', id, data: { 'text/plain': util.inspect(value) } });
  } catch (e) {
    if (e === TIMED_OUT || (e && e.code === 'ERR_SCRIPT_EXECUTION_TIMEOUT')) {
      send({ type: 'timeout', id });
    } else {
      send(errorEvent(id, e));
    }
  } finally {
    send({ type: 'done', id });
  }
}

const requests = [];
let busy = false;
function pump() {
  if (busy || requests.length === 0) return;
  busy = true;
  runCell(requests.shift()).finally(() => {
    busy = false;
    current = null;
    setImmediate(pump);
  });
}

const input = new net.Socket({ fd: REQUEST_FD, readable: true, writable: false });
input.setEncoding('utf8');
let pending = '';
input.on('data', (chunk) => {
  pending += chunk;
  let at;
  while ((at = pending.indexOf('\n')) >= 0) {
    const line = pending.slice(0, at);
    pending = pending.slice(at + 1);
    if (!line.trim()) continue;
    try {
      requests.push(JSON.parse(line));
    } catch (e) {}
  }
  pump();
});
input.on('end', () => process.exit(0));
input.on('error', () => process.exit(0));
send({ type: 'ready', version: process.version });
"""

_runner_lock = threading.Lock()


def js_runner_path() -> str:
    path = os.path.join(STATE_DIR, "js-runner.js")
    with _runner_lock:
        try:
            with open(path, encoding="utf-8") as f:
                if f.read() == JS_RUNNER:
                    return path
        except OSError:
            pass
        write_private_file(path, JS_RUNNER)
    return path


class NodeContext(ChildContext):
    """One Node.js child running JS_RUNNER: a persistent vm context."""

    kernel_name = "Node.js process"

    def __init__(self, cid: str, language: str, cwd: str | None, env: dict) -> None:
        super().__init__(cid)
        self.language = language
        self.seq = 0
        request_r, self.request_w = os.pipe()
        events_r, events_w = os.pipe()
        # --expose-internals: the REPL's top-level-await transform;
        # --experimental-vm-modules: import() in cells on Node < 20.12.
        args = [LANGUAGES.node or "node", "--expose-internals", "--experimental-vm-modules"]
        args += [js_runner_path(), str(request_r), str(events_w), language]
        try:
            self.spawn(args, cwd, env, subprocess.DEVNULL, (request_r, events_w), events_r)
        except BaseException:
            os.close(events_r)
            os.close(self.request_w)
            raise
        finally:
            os.close(request_r)
            os.close(events_w)
        deadline = time.monotonic() + 30
        startup = []
        while True:
            item = self.next_item(max(0.0, deadline - time.monotonic()))
            if item is None or item[0] == "eof":
                self.kill()
                self.release()
                detail = b"".join(i[2] for i in startup if i[0] == "raw").decode("utf-8", "replace").strip()
                raise ContextDead(f"node did not start ({self.exit_description()}){': ' + detail[-2000:] if detail else ''}")
            if item[0] == "event" and item[1].get("type") == "ready":
                break
            startup.append(item)

    def release(self) -> None:
        if self._released:
            return
        super().release()
        try:
            os.close(self.request_w)
        except OSError:
            pass

    def run(self, code: str, timeout_ms: int, out: CellOutput) -> dict:
        self.seq += 1
        rid = self.seq
        decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
        request = json.dumps({"id": rid, "cell": self.cells, "code": code, "timeout_ms": timeout_ms}) + "\n"
        start = time.monotonic()
        hard_deadline = start + timeout_ms / 1000 + JS_KILL_GRACE if timeout_ms > 0 else None
        timed_out = False
        killed = False
        aborted = False
        died = False
        self.reset_idle()
        self.running = True
        try:
            try:
                data = request.encode("utf-8", "replace")
                while data:
                    written = os.write(self.request_w, data)
                    data = data[written:]
            except OSError:
                died = True
            while not died:
                if hard_deadline is not None and time.monotonic() >= hard_deadline:
                    timed_out = killed = True
                    self.kill()
                    break
                if out.client_left():
                    aborted = True
                    self.kill()
                    break
                item = self.next_item(0.05)
                if item is None:
                    continue
                if item[0] == "eof":
                    died = True
                    break
                if item[0] == "raw":
                    text = decoders[item[1]].decode(item[2])
                    out.text(item[1], text)
                    continue
                event = item[1]
                kind = event.get("type")
                if kind in ("stdout", "stderr"):
                    out.text(kind, str(event.get("text", "")))
                    continue
                if event.get("id") != rid:
                    continue  # from a cell that was given up on
                if kind == "result":
                    out.result(mime_bundle(event.get("data")), True)
                elif kind == "error":
                    out.error(str(event.get("name", "Error")), str(event.get("value", "")), str(event.get("traceback", "")))
                elif kind == "timeout":
                    timed_out = True
                elif kind == "done":
                    break
        finally:
            self.running = False
        for stream, decoder in decoders.items():
            out.text(stream, decoder.decode(b"", True))
        if timed_out:
            if killed:
                out.error(
                    "TimeoutError",
                    f"the cell ran past {timeout_ms} ms and did not stop; its Node.js process was killed",
                    "",
                )
            else:
                out.error("TimeoutError", f"the cell ran past {timeout_ms} ms and was interrupted", "")
        if aborted:
            self.mark_dead("stopped: its client went away mid-cell, and a JavaScript cell stops only with its process")
        elif killed:
            self.mark_dead(f"stopped after a cell ran past its {timeout_ms} ms timeout")
        elif died:
            self.mark_dead(self.exit_description())
            out.error("KernelDied", self.died_value(), "")
        return {"timed_out": timed_out}


# ---------------------------------------------------------------------------
# Registry and HTTP


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[str, Context] = {}

    def add(self, ctx: Context) -> None:
        with self._lock:
            self._contexts[ctx.id] = ctx

    def get(self, cid: str) -> Context | None:
        with self._lock:
            return self._contexts.get(cid)

    def pop(self, cid: str) -> Context | None:
        with self._lock:
            return self._contexts.pop(cid, None)

    def all(self) -> list[Context]:
        with self._lock:
            return list(self._contexts.values())


REGISTRY = Registry()


class HTTPError(Exception):
    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body.get("error"))
        self.status = status
        self.body = body


def environment_change(env) -> dict:
    """What of a request's `env` (the environment the sandbox's commands
    start with now) differs from the one this daemon started with: a daemon
    a template's bake started predates each sandbox's own variables, and
    only those are laid over its contexts, so that what the daemon sets for
    its kernels stays."""
    if env is None:
        return {}
    valid = isinstance(env, dict) and all(
        isinstance(k, str) and k and "=" not in k and "\0" not in k and isinstance(v, str) and "\0" not in v
        for k, v in env.items()
    )
    if not valid:
        raise HTTPError(400, {"error": "env must be an object of variable names to string values"})
    return {k: v for k, v in env.items() if START_ENVIRONMENT.get(k) != v}


def new_context_id() -> str:
    while True:
        cid = "ctx_" + secrets.token_hex(6)
        if REGISTRY.get(cid) is None:
            return cid


def create_context(language: str, cwd: str | None, env: dict) -> Context:
    """A new context in `cwd` (the default when None), its environment the
    daemon's with `env` over it."""
    cid = new_context_id()
    if language == "python":
        kernel = SPARE.take(KERNEL_START_TIMEOUT)
        try:
            kernel.unnice()
            kernel.settle(cwd, env)
        except BaseException:
            threading.Thread(target=kernel.close, daemon=True).start()
            raise
        return PythonContext(cid, kernel)
    if language in ("javascript", "typescript"):
        return NodeContext(cid, language, cwd, env)
    if language == "bash":
        return BashContext(cid, cwd, env)
    raise ContextDead(f"unknown language {language}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "clade-contexts/1"
    sys_version = ""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    # -- plumbing

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size_line = self.rfile.readline(1024)
                try:
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                except ValueError:
                    raise HTTPError(400, {"error": "bad chunked body"})
                if size == 0:
                    while self.rfile.readline(65536).strip():
                        pass
                    return body
                if len(body) + size > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise HTTPError(413, {"error": "request body too large"})
                body += self.rfile.read(size)
                self.rfile.readline(16)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise HTTPError(400, {"error": "bad Content-Length"})
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise HTTPError(413, {"error": "request body too large"})
        return self.rfile.read(length) if length > 0 else b""

    def _json_body(self, body: bytes) -> dict:
        if not body.strip():
            return {}
        try:
            value = json.loads(body)
        except ValueError:
            raise HTTPError(400, {"error": "the body is not valid JSON"})
        if not isinstance(value, dict):
            raise HTTPError(400, {"error": "the body must be a JSON object"})
        return value

    def _send_json(self, status: int, value) -> None:
        data = json.dumps(value, ensure_ascii=False).encode("utf-8", "replace")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_empty(self, status: int) -> None:
        self.send_response(status)
        self.end_headers()

    def _dispatch(self, method: str) -> None:
        self._headers_sent = False
        try:
            body = self._read_body() if method in ("POST", "PUT", "PATCH") else b""
            self._route(method, urlsplit(self.path).path, body)
        except HTTPError as e:
            if not self._headers_sent:
                self._send_json(e.status, e.body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            log(f"{method} {self.path}: {traceback.format_exc()}")
            if not self._headers_sent:
                self.close_connection = True
                self._send_json(500, {"error": f"internal error: {e}"})

    def _route(self, method: str, path: str, body: bytes) -> None:
        parts = [p for p in path.split("/") if p]
        if parts == ["health"]:
            self._only(method, "GET")
            return self._health()
        if parts == ["warm"]:
            self._only(method, "POST")
            return self._warm()
        if parts == ["contexts"]:
            if method == "GET":
                return self._send_json(200, [ctx.info() for ctx in REGISTRY.all()])
            self._only(method, "POST")
            return self._create(self._json_body(body))
        if len(parts) == 2 and parts[0] == "contexts":
            if method == "GET":
                return self._send_json(200, self._context(parts[1]).info())
            self._only(method, "DELETE")
            return self._delete(parts[1])
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "run":
            self._only(method, "POST")
            return self._run(parts[1], self._json_body(body))
        raise HTTPError(404, {"error": "not found"})

    def _only(self, method: str, allowed: str) -> None:
        if method != allowed:
            raise HTTPError(405, {"error": f"method {method} not allowed here (use {allowed})"})

    def _context(self, cid: str) -> Context:
        ctx = REGISTRY.get(cid)
        if ctx is None:
            raise HTTPError(404, {"error": "context not found"})
        return ctx

    # -- endpoints

    def _health(self) -> None:
        languages = LANGUAGES.available()
        self._send_json(
            200,
            {"ok": True, "languages": languages, "spare_ready": "python" in languages and SPARE.ready()},
        )

    def _warm(self) -> None:
        if "python" not in LANGUAGES.available():
            return self._send_json(200, {"spare_ready": False})
        self._send_json(200, {"spare_ready": SPARE.warm(WARM_TIMEOUT)})

    def _create(self, request: dict) -> None:
        language = request.get("language")
        available = LANGUAGES.available()
        if not isinstance(language, str) or language not in available:
            raise HTTPError(
                400, {"error": f"language {language} is not available here", "available": available}
            )
        cwd = request.get("cwd")
        if cwd is not None:
            if not isinstance(cwd, str) or not cwd:
                raise HTTPError(400, {"error": "cwd must be a non-empty string"})
            if not os.path.isdir(cwd):
                raise HTTPError(400, {"error": f"cwd {cwd} is not a directory"})
            if not os.access(cwd, os.X_OK):
                raise HTTPError(400, {"error": f"cwd {cwd} is not accessible"})
            cwd = os.path.abspath(cwd)
        env = environment_change(request.get("env"))
        began = time.monotonic()
        try:
            ctx = create_context(language, cwd, env)
        except ContextDead as e:
            raise HTTPError(500, {"error": f"could not start a {language} context: {e}"})
        except OSError as e:
            raise HTTPError(500, {"error": f"could not start a {language} context: {e}"})
        REGISTRY.add(ctx)
        log(f"{ctx.id} ({language}) created in {time.monotonic() - began:.3f} s")
        self._send_json(201, {"id": ctx.id, "language": ctx.language, "created_at": ctx.created_at})

    def _delete(self, cid: str) -> None:
        ctx = REGISTRY.pop(cid)
        if ctx is None:
            raise HTTPError(404, {"error": "context not found"})
        ctx.delete()
        log(f"{cid} deleted")
        self._send_empty(204)

    def _run(self, cid: str, request: dict) -> None:
        ctx = self._context(cid)
        code = request.get("code")
        if not isinstance(code, str) or not code.strip():
            raise HTTPError(400, {"error": "code required"})
        timeout_ms = request.get("timeout_ms", 0)
        if timeout_ms is None:
            timeout_ms = 0
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)):
            raise HTTPError(400, {"error": "timeout_ms must be a number of milliseconds"})
        timeout_ms = max(0, int(timeout_ms))
        with ctx.lock:
            if ctx.deleted:
                raise HTTPError(404, {"error": "context not found"})
            if ctx.dead_reason is None and not ctx.alive():
                ctx.mark_dead(ctx.exit_description())
            if ctx.dead_reason is not None:
                raise HTTPError(
                    409, {"error": f"the context's kernel died ({ctx.dead_reason}); create a new context"}
                )
            ctx.cells += 1
            self.close_connection = True
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            self._headers_sent = True
            try:
                self.connection.settimeout(STREAM_WRITE_TIMEOUT)
            except OSError:
                pass
            out = CellOutput(self.wfile, self.connection)
            start = time.monotonic()
            try:
                extra = ctx.run(code, timeout_ms, out)
            except Exception as e:
                log(f"{cid}: run failed: {traceback.format_exc()}")
                out.error("InternalError", f"the daemon failed to run the cell: {e}", traceback.format_exc())
                extra = {"timed_out": False}
            timed_out = bool(extra.get("timed_out"))
            failed = out.errors > 0 or timed_out
            event = {
                "type": "end",
                "exit": 1 if failed else 0,
                "duration_ms": int((time.monotonic() - start) * 1000),
                "timed_out": timed_out,
                "truncated": out.truncated,
            }
            if ctx.language == "bash":
                status = extra.get("status")
                event["status"] = status if status is not None else (130 if timed_out else 1)
                if status not in (None, 0):
                    event["exit"] = 1
            out.end(event)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def shut_down_contexts() -> None:
    SPARE.shutdown()
    for ctx in REGISTRY.all():
        try:
            ctx.kill()
        except Exception:
            pass


def main(argv: list[str] | None = None) -> int:
    global STATE_DIR, DEFAULT_CWD, START_ENVIRONMENT
    parser = argparse.ArgumentParser(description="Clade code contexts daemon")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--state-dir", default="/run/clade/contexts")
    parser.add_argument("--no-spare", action="store_true", help="do not keep a spare Python kernel")
    args = parser.parse_args(argv)

    START_ENVIRONMENT = dict(os.environ)
    STATE_DIR = os.path.realpath(args.state_dir)
    os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
    DEFAULT_CWD = default_cwd()
    try:
        server = Server((args.host, args.port), Handler)
    except (OSError, OverflowError) as e:
        print(f"daemon: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    try:
        write_private_file(os.path.join(STATE_DIR, "daemon.pid"), f"{os.getpid()}\n")
    except OSError:
        pass
    log(f"listening on {args.host}:{args.port} (python {sys.version.split()[0]}, {sys.executable})")

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    # Handlers, not SIG_IGN: an ignored signal stays ignored across exec, and
    # the kernels must get SIGINT (interrupts) and SIGHUP/SIGQUIT as usual even
    # when the daemon was started with them ignored (e.g. in the background).
    signal.signal(signal.SIGHUP, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)

    def warm_up() -> None:
        if "python" in LANGUAGES.available() and not args.no_spare:
            SPARE.ensure()

    threading.Thread(target=warm_up, name="warm-up", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        log("stopping")
        shut_down_contexts()
        try:
            server.server_close()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
