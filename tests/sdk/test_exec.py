"""Exec (§3.3): blocking exec, check=True, the guest-enforced timeout,
run_code, and exec_stream with its callbacks and exit code."""

import threading
import time

import pytest
import requests
from pandastack import CommandFailed, ExecInterrupted, SandboxTimeout

from conftest import TEMPLATE, wait_for


def test_exec_returns_output_and_exit_code(sandbox):
    result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 3
    assert isinstance(result.duration_ms, int)


def test_exec_runs_a_shell_as_root(sandbox):
    assert sandbox.exec("id -u").stdout.strip() == "0"
    assert sandbox.exec("A=1; B=2; echo $((A+B)) | tr 3 x").stdout == "x\n"


def test_exec_output_is_utf8(sandbox):
    assert sandbox.exec("printf 'h\\303\\251llo \\342\\234\\223'").stdout == "héllo ✓"


def test_check_true_raises_command_failed(sandbox):
    with pytest.raises(CommandFailed) as failed:
        sandbox.exec("echo partial; echo bad >&2; exit 7", check=True)
    assert failed.value.exit_code == 7
    assert failed.value.stdout == "partial\n"
    assert failed.value.stderr == "bad\n"
    assert sandbox.exec("true", check=True).exit_code == 0


def test_a_timeout_raises_sandbox_timeout_and_kills_the_command(sandbox):
    started = time.monotonic()
    with pytest.raises(SandboxTimeout):
        sandbox.exec("echo $$ > /tmp/timed-out.pid; sleep 60", timeout_seconds=2)
    assert time.monotonic() - started < 30
    # The guest killed it: nothing of it is left running.
    alive = sandbox.exec("kill -0 $(cat /tmp/timed-out.pid) 2>/dev/null && echo alive || echo gone")
    assert alive.stdout.strip() == "gone"


def test_commands_run(sandbox):
    assert sandbox.commands.run("echo via-commands").stdout == "via-commands\n"


def test_run_code_python_and_shell(sandbox):
    result = sandbox.run_code("import sys\nprint(sum(range(10)), file=sys.stdout)\nprint('e', file=sys.stderr)")
    assert result.stdout == "45\n" and result.stderr == "e\n" and result.exit_code == 0
    assert sandbox.run_code("echo \"it's $((6*7))\"", language="bash").stdout == "it's 42\n"
    assert sandbox.run_code("raise SystemExit(4)").exit_code == 4
    with pytest.raises(ValueError):
        sandbox.run_code("x", language="cobol")


def test_exec_stream_calls_back_with_chunks_and_returns_the_exit_code(sandbox):
    out, err = [], []
    code = sandbox.exec_stream(
        "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo oops >&2; exit 5",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert code == 5
    assert "".join(out) == "line1\nline2\nline3\n"
    assert "".join(err) == "oops\n"


def test_exec_stream_delivers_output_while_the_command_runs(sandbox):
    seen = []
    first_at = []
    started = time.monotonic()

    def on_stdout(chunk):
        if not seen:
            first_at.append(time.monotonic() - started)
        seen.append(chunk)

    code = sandbox.exec_stream("echo early; sleep 3; echo late", on_stdout=on_stdout)
    total = time.monotonic() - started
    assert code == 0
    assert "".join(seen) == "early\nlate\n"
    assert first_at[0] < total - 2, "the first chunk came before the command ended"


def test_exec_stream_utf8(sandbox):
    out = []
    assert sandbox.exec_stream("printf 'h\\303\\251llo \\342\\234\\223\\n'", on_stdout=out.append) == 0
    assert "".join(out) == "héllo ✓\n"


def test_exec_stream_timeout_raises_sandbox_timeout(sandbox):
    with pytest.raises(SandboxTimeout):
        sandbox.exec_stream("echo start; sleep 60", timeout_seconds=2)


def _stream_until_the_server_goes(start_server, name, end_server):
    """Runs a long exec_stream on a dedicated server, ends the server with
    `end_server` once the first chunk arrived, and returns what exec_stream
    did: {"code": int} or {"error": exception}, and the chunks seen."""
    server = start_server(name)
    sb = server.client().sandboxes.create(template=TEMPLATE)
    out = []
    outcome = {}

    def run():
        try:
            outcome["code"] = sb.exec_stream("echo before; sleep 120; echo after", on_stdout=out.append)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: "".join(out) == "before\n", timeout=30, what="the first chunk")
    end_server(server)
    thread.join(60)
    assert not thread.is_alive(), "exec_stream returned after the server went away"
    return outcome, "".join(out)


def test_exec_stream_never_reports_success_when_the_server_is_killed(start_server):
    """The stream is the only channel of the exit code: a command whose
    server is killed (SIGKILL) mid-stream must never read as a success.

    The SDK raises ExecInterrupted only for a stream that *ends* without an
    `exit` event. A server killed outright cannot end its chunked response,
    and `requests` reports the cut body as ChunkedEncodingError, which the
    SDK lets through. (An HTTP/1.0 close-delimited stream would end cleanly,
    but `requests` then buffers 512 bytes per read, so output stops being
    live: not a trade worth making.)"""
    outcome, seen = _stream_until_the_server_goes(start_server, "killed", lambda s: s.kill())
    assert "code" not in outcome, f"a killed stream read as exit code {outcome.get('code')}"
    error = outcome["error"]
    assert isinstance(error, (ExecInterrupted, requests.exceptions.ChunkedEncodingError)), repr(error)
    assert seen == "before\n"


def test_exec_stream_raises_exec_interrupted_when_the_server_stops(start_server):
    """A server that stops (SIGTERM) while a command streams ends the stream
    without an `exit` event, which the SDK reports as ExecInterrupted with
    the partial output."""
    outcome, _ = _stream_until_the_server_goes(start_server, "stopped", lambda s: s.stop(timeout=20))
    error = outcome.get("error")
    assert isinstance(error, ExecInterrupted), f"expected ExecInterrupted, got {outcome!r}"
    assert error.partial_stdout == "before\n"
