"""A PTY through envd's process service, in the shared sandbox: an
interactive login shell of the given size that echoes what is typed, runs
it, follows a resize, and ends when killed.

The sync SDK gives a PTY's output by iterating its handle, which blocks; a
thread reads it here so that the test waits with deadlines of its own."""

from __future__ import annotations

import threading
import time
from typing import Optional

from e2b import CommandExitException, PtySize

# Seconds to wait for what was typed to show: a login shell under TCG is slow to start.
SHOW_TIMEOUT = 90


class PtyOutput:
    """Reads a PTY handle's output in a thread until its stream ends."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.data = bytearray()
        self.error: Optional[BaseException] = None
        self.ended = threading.Event()
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            self.handle.wait(on_pty=self._add)
        except BaseException as e:  # noqa: BLE001 (kept for the test to look at)
            self.error = e
        finally:
            self.ended.set()
            with self._changed:
                self._changed.notify_all()

    def _add(self, chunk: bytes) -> None:
        with self._changed:
            self.data.extend(chunk)
            self._changed.notify_all()

    def wait_for(self, needle: bytes, after: int = 0, timeout: float = SHOW_TIMEOUT) -> int:
        """Waits until `needle` shows past offset `after`; returns where it ends."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = self.data.find(needle, after)
                if found >= 0:
                    return found + len(needle)
                left = deadline - time.monotonic()
                if left <= 0 or self.ended.is_set():
                    raise AssertionError(
                        f"{needle!r} did not show (stream ended: {self.ended.is_set()}, error: {self.error!r}); "
                        f"output: {bytes(self.data[-2000:])!r}")
                self._changed.wait(min(left, 1.0))


def test_a_pty_runs_a_shell_that_echoes_follows_a_resize_and_ends_when_killed(sandbox):
    handle = sandbox.pty.create(size=PtySize(rows=24, cols=80), timeout=300)
    assert handle.pid > 0
    output = PtyOutput(handle)
    try:
        assert handle.pid in {process.pid for process in sandbox.commands.list()}

        # The typed line echoes back as typed, and its output shows after it.
        sandbox.pty.send_stdin(handle.pid, b"echo pty-$((6 * 7))\n")
        echoed = output.wait_for(b"echo pty-$((6 * 7))")
        at = output.wait_for(b"pty-42", after=echoed)

        sandbox.pty.send_stdin(handle.pid, b"stty size; echo who-$(whoami) term-$TERM\n")
        at = output.wait_for(b"24 80", after=at)
        at = output.wait_for(b"who-user term-xterm-256color", after=at)

        sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=120))
        sandbox.pty.send_stdin(handle.pid, b"stty size\n")
        output.wait_for(b"30 120", after=at)

        # Ctrl-C reaches the shell's foreground job through the terminal.
        sandbox.pty.send_stdin(handle.pid, b"sleep 600\n")
        time.sleep(1)
        sandbox.pty.send_stdin(handle.pid, b"\x03")
        # Apart: the terminal drops what was typed ahead of an interrupt.
        time.sleep(1)
        sandbox.pty.send_stdin(handle.pid, b"echo interrupted-$((1 + 1))\n")
        output.wait_for(b"interrupted-2", after=at)

        assert sandbox.pty.kill(handle.pid) is True
        assert output.ended.wait(60), "the PTY's stream did not end when it was killed"
        assert isinstance(output.error, CommandExitException), output.error
        assert sandbox.pty.kill(handle.pid) is False
    finally:
        if not output.ended.is_set():
            sandbox.pty.kill(handle.pid)


def test_a_pty_that_exits_ends_its_stream_with_its_code(sandbox):
    handle = sandbox.pty.create(size=PtySize(rows=24, cols=80), timeout=300)
    output = PtyOutput(handle)
    try:
        sandbox.pty.send_stdin(handle.pid, b"exit 5\n")
        assert output.ended.wait(SHOW_TIMEOUT), f"the PTY did not end: {bytes(output.data[-500:])!r}"
        assert isinstance(output.error, CommandExitException) and output.error.exit_code == 5, output.error
    finally:
        if not output.ended.is_set():
            sandbox.pty.kill(handle.pid)


def test_a_pty_runs_as_the_user_and_in_the_directory_asked_for(sandbox):
    handle = sandbox.pty.create(size=PtySize(rows=24, cols=80), user="root", cwd="/tmp", timeout=300)
    output = PtyOutput(handle)
    try:
        sandbox.pty.send_stdin(handle.pid, b"echo who-$(whoami)-in-$(pwd)\n")
        output.wait_for(b"who-root-in-/tmp")
    finally:
        sandbox.pty.kill(handle.pid)
