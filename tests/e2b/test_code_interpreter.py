"""The code interpreter (`e2b_code_interpreter.Sandbox.run_code`, port
49999) on Clade's code contexts, in one `code-interpreter` sandbox: a
cell's value, state kept between cells, a matplotlib chart as a PNG, a
DataFrame as HTML, an exception as the execution's error, output streamed
to callbacks, environment variables of one cell, and contexts of their
own."""

from __future__ import annotations

import base64
import threading
from typing import Iterator, List

import pytest
from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import Execution, OutputMessage, Result
from e2b_code_interpreter import Sandbox as CodeSandbox

from conftest import IMAGE_BUILD_TIMEOUT, REQUEST_TIMEOUT, RUN, SANDBOX_TIMEOUT, kill_quietly

# The first test may build the image (a fixture's time counts as the test's).
pytestmark = pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)

# Seconds a cell may run: the first one starts the kernel, under TCG.
CELL_TIMEOUT = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def notebook(e2b, code_template) -> Iterator[CodeSandbox]:
    sandbox = CodeSandbox.create(template=code_template, timeout=SANDBOX_TIMEOUT, metadata={"run": RUN},
                                 envs={"SANDBOX_VAR": "from create"}, request_timeout=REQUEST_TIMEOUT)
    try:
        yield sandbox
    finally:
        kill_quietly(sandbox.sandbox_id)


def run(notebook: CodeSandbox, code: str, **kwargs) -> Execution:
    kwargs.setdefault("timeout", CELL_TIMEOUT)
    kwargs.setdefault("request_timeout", REQUEST_TIMEOUT)
    return notebook.run_code(code, **kwargs)


def test_a_cell_gives_its_value_and_the_state_stays_for_the_next(notebook):
    first = run(notebook, "x = 2; x * 21")
    assert first.error is None, first.error
    assert first.text == "42"
    assert [r.is_main_result for r in first.results] == [True]
    assert run(notebook, "y = x + 1").results == []
    assert run(notebook, "x * y").text == "6"
    printed = run(notebook, "print('printed', x)")
    assert printed.logs.stdout == ["printed 2\n"] and printed.results == []


def test_a_matplotlib_chart_is_a_png(notebook):
    chart = run(notebook, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    assert chart.error is None, chart.error
    assert chart.results and chart.results[0].png, chart.results
    assert base64.b64decode(chart.results[0].png)[:8] == PNG_MAGIC


def test_a_dataframe_is_an_html_table(notebook):
    table = run(notebook, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert table.error is None, table.error
    assert table.results[0].html and "<table" in table.results[0].html, table.results
    assert table.results[0].is_main_result and "a" in (table.text or "")


def test_an_exception_is_the_executions_error(notebook):
    failed = run(notebook, "1 / 0")
    assert failed.error is not None
    assert failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value
    assert "ZeroDivisionError" in failed.error.traceback
    assert failed.results == []
    # The kernel goes on.
    assert run(notebook, "x").text == "2"


def test_output_is_streamed_to_callbacks(notebook):
    stdout: List[OutputMessage] = []
    stderr: List[OutputMessage] = []
    results: List[Result] = []
    done = run(notebook, "import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n'the value'",
               on_stdout=stdout.append, on_stderr=stderr.append, on_result=results.append)
    assert [m.line for m in stdout] == ["to out\n"] and not stdout[0].error
    assert [m.line for m in stderr] == ["to err\n"] and stderr[0].error
    assert stdout[0].timestamp  # the kernel message's date, as E2B sends it
    assert [r.text for r in results] == ["the value"]
    assert done.logs.stdout == ["to out\n"] and done.logs.stderr == ["to err\n"]


def test_a_cells_environment_variables_are_its_own(notebook):
    assert run(notebook, "import os; os.environ.get('GREETING')", envs={"GREETING": "hi"}).text == "hi"
    assert run(notebook, "import os; os.environ.get('GREETING', 'unset')").text == "unset"


def test_the_sandboxs_variables_reach_every_language_and_a_cells_own_win(notebook):
    # The template's kernels were started at its bake, before this sandbox
    # had variables of its own.
    probes = {"python": "import os; os.environ.get('SANDBOX_VAR', 'unset')",
              "js": "process.env.SANDBOX_VAR ?? 'unset'",
              "bash": "echo \"${SANDBOX_VAR-unset}\""}
    for language, code in probes.items():
        execution = run(notebook, code, language=language)
        assert execution.error is None, (language, execution.error)
        seen = execution.text if language != "bash" else "".join(execution.logs.stdout).strip()
        assert seen == "from create", (language, execution)
    overridden = run(notebook, "import os; os.environ['SANDBOX_VAR']", envs={"SANDBOX_VAR": "the cell's"})
    assert overridden.text == "the cell's"
    assert run(notebook, "import os; os.environ['SANDBOX_VAR']").text == "from create"


def test_a_context_of_its_own_has_its_own_state_and_directory(notebook):
    context = notebook.create_code_context(cwd="/tmp")
    assert context.id and context.language == "python" and context.cwd == "/tmp"
    try:
        assert context.id in {c.id for c in notebook.list_code_contexts()}
        # The default context's `x` is not here.
        unknown = run(notebook, "x", context=context)
        assert unknown.error is not None and unknown.error.name == "NameError"
        run(notebook, "z = 5", context=context)
        assert run(notebook, "z * 2", context=context).text == "10"
        assert run(notebook, "import os; os.getcwd()", context=context).text == "/tmp"  # E2B strips a string's quotes
        assert run(notebook, "'z' in globals()").text == "False"
    finally:
        notebook.remove_code_context(context)
    assert context.id not in {c.id for c in notebook.list_code_contexts()}
    with pytest.raises(NotFoundException):
        run(notebook, "1", context=context)

    default = notebook.create_code_context()
    try:
        assert default.cwd == "/home/user" and default.language == "python"
    finally:
        notebook.remove_code_context(default.id)


def test_a_sandbox_killed_during_a_cell_raises_the_sdks_killed_error(e2b, code_template):
    sandbox = CodeSandbox.create(template=code_template, timeout=SANDBOX_TIMEOUT, metadata={"run": RUN},
                                 request_timeout=REQUEST_TIMEOUT)
    try:
        assert run(sandbox, "1 + 1").text == "2"  # the kernel is up: the kill lands mid-cell
        timer = threading.Timer(2.0, sandbox.kill)
        timer.start()
        try:
            # As on E2B: the connection drops with the sandbox, and the SDK,
            # finding the sandbox gone, says so (not an execution's error).
            with pytest.raises(TimeoutException, match="sandbox was killed"):
                run(sandbox, "import time; time.sleep(300)")
        finally:
            timer.cancel()
    finally:
        kill_quietly(sandbox.sandbox_id)
