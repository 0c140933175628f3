"""Code contexts through the unmodified SDK (§3.4, issue 28): a Python
context on a real Jupyter kernel in the `code-interpreter` template keeps
its variables across cells, gives a matplotlib chart as a real PNG, a
DataFrame as an HTML table and `1/0` as a traceback; a timeout interrupts
the cell and leaves the state; the contexts survive a hibernation, and the
children of a fork tree get their parent's contexts with their variables;
JavaScript and bash contexts keep their state; another workspace gets 404
on every route."""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Iterator

import pandastack
import pytest
import requests
from pandastack.sandbox import CodeContext

from test_templates import IMAGE_BUILD_TIMEOUT, built

TEMPLATE = "code-interpreter"


@pytest.fixture(scope="module")
def notebook(server, client) -> Iterator[pandastack.Sandbox]:
    """A code-interpreter sandbox the tests of this module share."""
    built(server, TEMPLATE)
    sb = client.sandboxes.create(template=TEMPLATE, ttl_seconds=3600)
    try:
        yield sb
    finally:
        sb.kill()


def png_size(b64: str) -> tuple:
    data = base64.b64decode(b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)
def test_a_python_context_keeps_state_and_gives_charts_tables_and_tracebacks(notebook):
    started = time.monotonic()
    ctx = notebook.create_code_context()
    first = ctx.run_code("1 + 1")
    print(f"first context → first result: {time.monotonic() - started:.2f} s")
    assert first.text == "2" and first.exit_code == 0, first
    assert ctx.run_code("x = 41\nprint('set')").stdout == "set\n"
    assert ctx.run_code("x + 1").text == "42"

    chart = ctx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    assert chart.error is None, chart.error
    width, height = png_size(chart.png)
    assert width > 100 and height > 100, (width, height)
    # A figure as the cell's last expression is shown too.
    figure = ctx.run_code("fig, ax = plt.subplots()\nax.bar(['a', 'b'], [1, 2])\nfig")
    assert figure.png and png_size(figure.png)[0] > 100

    table = ctx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    html = [r.html for r in table.results if r.html]
    assert html and "<table" in html[0], table.results
    assert "a" in (table.text or "")

    failed = ctx.run_code("1/0")
    assert failed.exit_code != 0 and failed.error and "ZeroDivisionError" in failed.error, failed
    assert ctx.run_code("x").text == "41", "an error keeps the state"

    with pytest.raises(pandastack.SandboxTimeout):
        ctx.run_code("import time\ntime.sleep(120)", timeout_seconds=3)
    assert ctx.run_code("x * 2").text == "82", "the interrupted cell left the state"
    ctx.close()


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)
def test_javascript_and_bash_contexts_keep_their_state(notebook):
    js = notebook.create_code_context("js")
    assert js.run_code("let x = 41; console.log('hi')").stdout == "hi\n"
    assert js.run_code("x + 1").text == "42"
    thrown = js.run_code("throw new Error('boom')")
    assert thrown.error and "boom" in thrown.error
    js.close()

    sh = notebook.create_code_context("bash")
    sh.run_code("cd /tmp && X=5 && greet() { echo hello $1; }")
    assert sh.run_code("echo $X; pwd; greet you").stdout == "5\n/tmp\nhello you\n"
    assert sh.run_code("false").exit_code == 1
    sh.close()


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 900)
def test_contexts_survive_hibernation_and_forks_carry_them_to_every_child(client, server, notebook):
    ctx = notebook.create_code_context()
    ctx.run_code("x = 41")
    notebook.hibernate()
    notebook.wake()
    assert ctx.run_code("x").text == "41", "the kernel came back with the sandbox"

    reply = requests.post(f"{server.url}/v1/sandboxes/{notebook.id}/fork-tree",
                          headers={"Authorization": f"Bearer {server.admin_key}"}, json={"count": 2}, timeout=300)
    assert reply.status_code in (200, 201), reply.text
    children = [c["id"] for c in (reply.json().get("children") or reply.json().get("sandboxes") or [])]
    assert len(children) == 2, reply.json()
    try:
        for child_id in children:
            child = client.sandboxes.get(child_id)
            in_child = CodeContext(child, ctx.id, "python")
            assert in_child.run_code("x + 1").text == "42", child_id
            in_child.run_code("x = 0")
        assert ctx.run_code("x").text == "41", "a child's change stays in the child"
    finally:
        for child_id in children:
            requests.delete(f"{server.url}/v1/sandboxes/{child_id}", headers={"Authorization": f"Bearer {server.admin_key}"},
                            timeout=60)
    ctx.close()


def test_contexts_are_checked_and_scoped_to_the_workspace(server, client, other_client, notebook):
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    base = f"{server.url}/v1/sandboxes/{notebook.id}/repl/sessions"
    unknown = requests.post(base, headers=headers, json={"language": "cobol"}, timeout=60)
    assert unknown.status_code == 400 and "supported: python" in unknown.json()["error"], unknown.text
    ctx = notebook.create_code_context()
    listed = requests.get(base, headers=headers, timeout=60).json()
    assert ctx.id in [c["id"] for c in listed] and all(c["sandbox_id"] == notebook.id for c in listed), listed
    assert requests.post(f"{base}/{ctx.id}/run", headers=headers, json={"code": " "}, timeout=60).status_code == 400

    other = {"Authorization": f"Bearer {other_client.api_key}"}
    for method, url, body in [("POST", base, {"language": "python"}), ("GET", base, None),
                              ("POST", f"{base}/{ctx.id}/run", {"code": "1"}), ("DELETE", f"{base}/{ctx.id}", None)]:
        reply = requests.request(method, url, headers=other, json=body, timeout=60)
        assert reply.status_code == 404, (method, url, reply.status_code, reply.text)
    with pytest.raises(pandastack.NotFoundError):
        CodeContext(notebook, "ctx_000000000000").run_code("1")
    ctx.close()
    assert requests.delete(f"{base}/{ctx.id}", headers=headers, timeout=60).status_code == 404


def test_a_template_without_a_kernel_names_the_one_that_has_it(client):
    sb = client.sandboxes.create(template="base")
    try:
        with pytest.raises(pandastack.BadRequestError) as refused:
            sb.create_code_context("python")
        assert "code-interpreter" in str(refused.value)
        sh = sb.create_code_context("bash")
        assert sh.run_code("echo $((6 * 7))").stdout == "42\n"
    finally:
        sb.kill()


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)
def test_contexts_survive_pause_and_come_back_in_a_sandbox_made_from_a_snapshot(client, notebook):
    ctx = notebook.create_code_context()
    ctx.run_code("from_before = 'kept'")
    notebook.pause()
    notebook.resume()
    assert ctx.run_code("from_before").text == "'kept'"
    snap = notebook.snapshot()
    restored = client.sandboxes.create(from_snapshot=snap)
    try:
        again = CodeContext(restored, ctx.id, "python")
        assert again.run_code("from_before + '!'").text == "'kept!'"
    finally:
        restored.kill()
        client.snapshots.delete(snap)
    ctx.close()


def test_a_cell_streams_its_output_as_events_and_a_dead_kernel_says_so(server, notebook):
    headers = {"Authorization": f"Bearer {server.admin_key}", "Accept": "text/event-stream"}
    ctx = notebook.create_code_context()
    code = "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')\n6 * 7"
    started = time.monotonic()
    events = []
    with requests.post(f"{server.url}/v1/sandboxes/{notebook.id}/repl/sessions/{ctx.id}/run", headers=headers,
                       json={"code": code}, stream=True, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in reply.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((time.monotonic() - started, name, json.loads(line[len("data: "):])))
    names = [name for _, name, _ in events]
    assert names[0] == "stdout" and names[-1] == "execution" and "result" in names, names
    first = next(at for at, name, data in events if name == "stdout" and "first" in data["text"])
    assert events[-1][0] - first > 1.5, "the first line came while the cell still ran"
    assert events[-1][2]["results"][0]["text/plain"] == "42"

    died = ctx.run_code("import os\nos._exit(3)")
    assert died.exit_code != 0 and "KernelDied" in (died.error or ""), died
    with pytest.raises(pandastack.BadRequestError) as refused:
        ctx.run_code("1")
    assert "create a new context" in str(refused.value)


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)
def test_typescript_runs_in_the_agent_template(server, client):
    built(server, "agent")
    sb = client.sandboxes.create(template="agent")
    try:
        ts = sb.create_code_context("ts")
        assert ts.run_code("const x: number = 41;\nx + 1").text == "42"
        assert ts.run_code("function twice(n: number): number { return 2 * n }\ntwice(x)").text == "82"
    finally:
        sb.kill()
