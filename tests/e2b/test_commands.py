"""Commands through envd's process service (Connect over HTTP), in the
shared sandbox: a blocking run, streamed output, a non-zero exit, the
command timeout, background commands (their pid, list, connect, kill),
stdin, working directory, user and environment, and a background command
that outlives the stream that started it."""

from __future__ import annotations

import time
import uuid
from typing import List

import pytest
from e2b import (
    CommandExitException, SandboxNotRunningException, SandboxUnreachableException, TimeoutException,
)

from conftest import wait_for

# Seconds a short command may take end to end (bash -l under TCG is slow).
COMMAND_TIMEOUT = 120


def running_pids(sandbox) -> List[int]:
    return [process.pid for process in sandbox.commands.list()]


def test_a_command_runs_to_its_end_with_its_output_and_exit_code(sandbox):
    result = sandbox.commands.run("echo hello; echo oops >&2", timeout=COMMAND_TIMEOUT)
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "oops\n", 0)
    assert result.error is None
    # Bytes that are not UTF-8 arrive, replaced, instead of breaking the stream.
    assert sandbox.commands.run(r"printf 'caf\xc3\xa9 \xff\n'", timeout=COMMAND_TIMEOUT).stdout == "café \ufffd\n"


def test_output_is_streamed_to_callbacks_as_it_comes(sandbox):
    stdout: List[str] = []
    stderr: List[str] = []
    result = sandbox.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.2; done",
        on_stdout=stdout.append, on_stderr=stderr.append, timeout=COMMAND_TIMEOUT,
    )
    assert "".join(stdout) == "out1\nout2\nout3\n" == result.stdout
    assert "".join(stderr) == "err1\nerr2\nerr3\n" == result.stderr
    # Iterating a background command's handle gives the same chunks.
    handle = sandbox.commands.run("echo a; echo b >&2", background=True, timeout=COMMAND_TIMEOUT)
    chunks = list(handle)
    assert "".join(out for out, _, _ in chunks if out) == "a\n"
    assert "".join(err for _, err, _ in chunks if err) == "b\n"


def test_a_non_zero_exit_raises_with_the_output(sandbox):
    with pytest.raises(CommandExitException) as raised:
        sandbox.commands.run("echo partial; echo bad >&2; exit 3", timeout=COMMAND_TIMEOUT)
    assert raised.value.exit_code == 3
    assert raised.value.stdout == "partial\n" and raised.value.stderr == "bad\n"
    assert "3" in str(raised.value)


def test_a_command_past_its_timeout_raises_a_timeout(sandbox):
    started = time.monotonic()
    with pytest.raises(TimeoutException) as raised:
        sandbox.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - started < 25, "the wait outlasted its 2 s timeout"
    # The deadline, not a sandbox that went away.
    assert not isinstance(raised.value, (SandboxNotRunningException, SandboxUnreachableException)), raised.value
    assert sandbox.commands.run("echo after", timeout=COMMAND_TIMEOUT).stdout == "after\n"


def test_a_background_command_is_listed_connected_to_and_killed(sandbox):
    # Deadlines on the streams only so that a stream that never ends fails the test instead of hanging it.
    handle = sandbox.commands.run("sleep 600", background=True, timeout=COMMAND_TIMEOUT)
    assert isinstance(handle.pid, int) and handle.pid > 0
    listed = {process.pid: process for process in sandbox.commands.list()}
    assert handle.pid in listed, listed
    assert "sleep 600" in " ".join([listed[handle.pid].cmd, *listed[handle.pid].args]), listed[handle.pid]

    # A second stream of the same command.
    again = sandbox.commands.connect(handle.pid, timeout=COMMAND_TIMEOUT)
    assert again.pid == handle.pid

    assert sandbox.commands.kill(handle.pid) is True
    wait_for(lambda: handle.pid not in running_pids(sandbox), timeout=30, what="the killed command gone from the list")
    # Both streams end with the kill: a non-zero exit.
    for stream in (handle, again):
        with pytest.raises(CommandExitException):
            stream.wait()
    assert sandbox.commands.kill(handle.pid) is False


def test_stdin_reaches_a_command_started_with_it(sandbox):
    handle = sandbox.commands.run("cat", background=True, stdin=True, timeout=COMMAND_TIMEOUT)
    sandbox.commands.send_stdin(handle.pid, "ping\n")
    handle.send_stdin(b"pong\n")
    sandbox.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert (result.stdout, result.exit_code) == ("ping\npong\n", 0)


def test_commands_run_as_user_in_its_home_unless_told_otherwise(sandbox):
    def run(cmd: str, **kwargs) -> str:
        return sandbox.commands.run(cmd, timeout=COMMAND_TIMEOUT, **kwargs).stdout

    assert run("whoami") == "user\n"
    assert run("pwd") == "/home/user\n"
    assert run("echo $HOME") == "/home/user\n"
    assert run("whoami", user="root") == "root\n"
    assert run("pwd", cwd="/tmp") == "/tmp\n"
    assert run("echo $BAR", envs={"BAR": "baz"}) == "baz\n"
    # A command's environment is its own.
    assert run("echo ${BAR:-unset}") == "unset\n"


def test_a_background_command_outlives_its_stream_and_can_be_reconnected(sandbox):
    tag = uuid.uuid4().hex[:8]
    handle = sandbox.commands.run(
        f"echo started-{tag}; while [ ! -e /tmp/go-{tag} ]; do sleep 0.2; done; echo late-{tag}; exit 7",
        background=True, timeout=0,
    )
    pid = handle.pid
    handle.disconnect()
    # Still running with nobody listening.
    time.sleep(2)
    assert pid in running_pids(sandbox)

    again = sandbox.commands.connect(pid, timeout=COMMAND_TIMEOUT)
    sandbox.commands.run(f"touch /tmp/go-{tag}", timeout=COMMAND_TIMEOUT)
    with pytest.raises(CommandExitException) as raised:
        again.wait()
    assert raised.value.exit_code == 7
    assert f"late-{tag}\n" in raised.value.stdout
    wait_for(lambda: pid not in running_pids(sandbox), timeout=30, what="the finished command gone from the list")
