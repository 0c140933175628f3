"""Commands: blocking and streamed, their errors, and aborts that reach the guest."""

from __future__ import annotations

import asyncio
import time

import pytest

import clade
from conftest import EXEC_TIMEOUT, assert_no_sleep_600_left


def test_exec_returns_the_commands_output_and_exit_code(sandbox: clade.Sandbox) -> None:
    result = sandbox.exec("echo out; echo err >&2; exit 3", timeout=EXEC_TIMEOUT)
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    assert result.duration_ms >= 0


def test_exec_runs_in_cwd_with_env_set_verbatim(sandbox: clade.Sandbox) -> None:
    # The value reaches the command as given: no shell expands `$HOME` or `...`.
    greeting = "hello 'world' $HOME `id` \\n"
    result = sandbox.exec('printf "%s|%s" "$GREETING" "$(pwd)"', env={"GREETING": greeting}, cwd="/tmp", timeout=EXEC_TIMEOUT)
    assert result.stdout == f"{greeting}|/tmp"
    streamed = list(sandbox.exec_stream('printf "%s|%s" "$GREETING" "$(pwd)"', env={"GREETING": greeting}, cwd="/usr", timeout=EXEC_TIMEOUT))
    assert "".join(e.text for e in streamed if isinstance(e, clade.Stdout)) == f"{greeting}|/usr"
    with pytest.raises(clade.BadRequestError, match="cwd"):
        sandbox.exec("true", cwd="relative/dir")


def test_exec_with_check_raises_with_exit_code_and_output(sandbox: clade.Sandbox) -> None:
    with pytest.raises(clade.CommandFailedError) as failed:
        sandbox.exec("echo partial; echo broken >&2; exit 7", check=True, timeout=EXEC_TIMEOUT)
    assert failed.value.exit_code == 7
    assert failed.value.stdout == "partial\n"
    assert "broken" in failed.value.stderr and "broken" in str(failed.value)


def test_a_command_past_its_timeout_is_a_gateway_timeout(sandbox: clade.Sandbox) -> None:
    with pytest.raises(clade.GatewayTimeoutError) as timed_out:
        sandbox.exec("sleep 30", timeout=1)
    assert "deadline exceeded" in timed_out.value.error


def test_exec_stream_yields_output_in_order_then_the_exit(sandbox: clade.Sandbox) -> None:
    events = list(sandbox.exec_stream("for i in 1 2 3; do echo line$i; sleep 0.2; done; echo oops >&2; exit 4", timeout=EXEC_TIMEOUT))
    stdout = "".join(e.text for e in events if isinstance(e, clade.Stdout))
    assert stdout == "line1\nline2\nline3\n"
    assert "".join(e.text for e in events if isinstance(e, clade.Stderr)) == "oops\n"
    assert events[-1] == clade.Exit(4)
    assert sum(isinstance(e, clade.Exit) for e in events) == 1


def test_aborting_a_blocking_exec_kills_the_command_in_the_guest(sandbox: clade.Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(clade.APITimeoutError):
        sandbox.exec("sleep 600", timeout=900, request_timeout=1.5)
    assert time.monotonic() - started < 30
    assert_no_sleep_600_left(sandbox)


def test_leaving_an_exec_stream_early_kills_the_command_in_the_guest(sandbox: clade.Sandbox) -> None:
    for event in sandbox.exec_stream("echo started; sleep 600", timeout=900):
        assert event == clade.Stdout("started\n")
        break
    assert_no_sleep_600_left(sandbox)


async def test_cancelling_an_async_exec_kills_the_command_in_the_guest(aclient: clade.AsyncClade, sandbox: clade.Sandbox) -> None:
    asandbox = await aclient.sandboxes.get(sandbox.id)
    task = asyncio.create_task(asandbox.exec("sleep 600", timeout=900))
    await asyncio.sleep(1.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(assert_no_sleep_600_left, sandbox)


async def test_async_exec_stream_yields_typed_events_and_closes_early(aclient: clade.AsyncClade, sandbox: clade.Sandbox) -> None:
    asandbox = await aclient.sandboxes.get(sandbox.id)
    events = [e async for e in asandbox.exec_stream("echo a; echo b >&2; exit 2", timeout=EXEC_TIMEOUT)]
    assert clade.Stdout("a\n") in events and clade.Stderr("b\n") in events and events[-1] == clade.Exit(2)
    async with asandbox.exec_stream("echo go; sleep 600", timeout=900) as stream:
        async for event in stream:
            assert event == clade.Stdout("go\n")
            break
    await asyncio.to_thread(assert_no_sleep_600_left, sandbox)
