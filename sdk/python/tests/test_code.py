"""Code contexts: persistent interpreters with rich results (needs the
code-interpreter template)."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest

import clade
from conftest import EXEC_TIMEOUT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def interpreter(client: clade.Clade, code_interpreter_ready: None) -> Iterator[clade.Sandbox]:
    with client.sandboxes.create("code-interpreter", env={"SANDBOX_VAR": "from create"}) as sb:
        yield sb


def test_run_code_keeps_state_and_returns_the_value(interpreter: clade.Sandbox) -> None:
    interpreter.run_code("x = 41", timeout=EXEC_TIMEOUT)
    execution = interpreter.run_code("print('side'); x + 1", timeout=EXEC_TIMEOUT)
    assert execution.stdout == "side\n" and execution.text == "42" and execution.error is None


def test_code_sees_the_sandboxs_variables(interpreter: clade.Sandbox) -> None:
    # The template's kernel was started at its bake, before the sandbox had them.
    assert interpreter.run_code("import os; os.environ['SANDBOX_VAR']", timeout=EXEC_TIMEOUT).text == "'from create'"
    bash = interpreter.run_code('echo "$SANDBOX_VAR"', language="bash", timeout=EXEC_TIMEOUT)
    assert bash.stdout == "from create\n"


def test_a_matplotlib_chart_comes_back_as_png_bytes(interpreter: clade.Sandbox) -> None:
    execution = interpreter.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('sdk')\nplt.show()", timeout=EXEC_TIMEOUT
    )
    charts = [r for r in execution.results if r.png is not None]
    assert charts, f"no PNG among {execution.results}"
    png = charts[0].png
    assert png is not None and png.startswith(PNG_MAGIC)
    assert "image/png" in charts[0].formats()


def test_a_raising_cell_reports_its_error(interpreter: clade.Sandbox) -> None:
    execution = interpreter.run_code("1 / 0", timeout=EXEC_TIMEOUT)
    assert execution.error is not None and "ZeroDivisionError" in execution.error


def test_streamed_cells_and_explicit_contexts(interpreter: clade.Sandbox) -> None:
    context = interpreter.create_code_context("python")
    try:
        assert context.id in [c.id for c in interpreter.list_code_contexts()]
        events = list(context.run_stream("import time\nfor i in range(2):\n    print(i, flush=True)\n'done'", timeout=EXEC_TIMEOUT))
        assert "".join(e.text for e in events if isinstance(e, clade.Stdout)) == "0\n1\n"
        assert isinstance(events[-1], clade.CellDone) and events[-1].execution.text == "'done'"
        assert any(isinstance(e, clade.CellResult) for e in events)
        bash = interpreter.run_code("cd /tmp && pwd", language="bash", timeout=EXEC_TIMEOUT)
        assert bash.stdout.strip() == "/tmp"
    finally:
        context.delete()
    assert context.id not in [c.id for c in interpreter.list_code_contexts()]


async def test_async_run_code(aclient: clade.AsyncClade, interpreter: clade.Sandbox) -> None:
    asandbox = await aclient.sandboxes.get(interpreter.id)
    execution = await asandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})", timeout=EXEC_TIMEOUT)
    assert execution.results and execution.results[-1].html is not None


SLEEPING_CELL = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)"


def _assert_runs_promptly_with_its_state(context: clade.CodeContext) -> None:
    """The aborted cell no longer holds the kernel: the next one answers
    at once, and what earlier cells made is still there."""
    started = time.monotonic()
    try:
        execution = context.run("kept", timeout=EXEC_TIMEOUT, request_timeout=30)
    except clade.APITimeoutError:
        raise AssertionError("the next cell got no answer in 30 s: the aborted cell still holds the kernel") from None
    assert execution.text == "'state'", execution
    assert time.monotonic() - started < 30


@pytest.fixture
def python_context(interpreter: clade.Sandbox) -> Iterator[clade.CodeContext]:
    context = interpreter.create_code_context("python")
    context.run("kept = 'state'", timeout=EXEC_TIMEOUT)
    yield context
    context.delete()


def test_aborting_a_cell_interrupts_it_and_the_context_keeps_its_state(python_context: clade.CodeContext) -> None:
    with pytest.raises(clade.APITimeoutError):
        python_context.run(SLEEPING_CELL, timeout=900, request_timeout=1.5)
    _assert_runs_promptly_with_its_state(python_context)


def test_leaving_a_streamed_cell_early_interrupts_it(python_context: clade.CodeContext) -> None:
    with python_context.run_stream(SLEEPING_CELL, timeout=900) as events:
        for event in events:
            assert event == clade.Stdout("sleeping\n")
            break  # closing the stream closes its connection: the cell is interrupted
    _assert_runs_promptly_with_its_state(python_context)


async def test_cancelling_an_async_cell_interrupts_it(aclient: clade.AsyncClade, interpreter: clade.Sandbox) -> None:
    asandbox = await aclient.sandboxes.get(interpreter.id)
    context = await asandbox.create_code_context("python")
    try:
        await context.run("kept = 'state'", timeout=EXEC_TIMEOUT)
        task = asyncio.create_task(context.run(SLEEPING_CELL, timeout=900))
        await asyncio.sleep(1.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = time.monotonic()
        execution = await context.run("kept", timeout=EXEC_TIMEOUT, request_timeout=30)
        assert execution.text == "'state'" and time.monotonic() - started < 30
    finally:
        await context.delete()
