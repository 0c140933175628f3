"""Clade's MCP server through the official MCP Python SDK, over stdio and
over streamable HTTP (each test runs on both): the tools and their schemas,
commands (streamed as progress), binary files, code cells with charts,
forks, tool errors for sandboxes that are not the caller's, resources, and
a session's sandboxes going with it."""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from typing import Any, List

import pytest

from conftest import BIN, CladeServer, connect, skip_or_fail, wait_for

pytestmark = pytest.mark.anyio

EXPECTED_TOOLS = {
    "create_sandbox", "list_sandboxes", "get_sandbox", "delete_sandbox", "run_command", "read_file", "write_file",
    "list_files", "run_code", "fork_sandbox", "promote_sandbox", "snapshot_sandbox", "hibernate_sandbox",
    "wake_sandbox", "expose_port",
}


def text_of(result: Any) -> str:
    return "\n".join(item.text for item in result.content if item.type == "text")


def ok(result: Any) -> Any:
    """The result of a tool call that must have worked."""
    assert not result.is_error, text_of(result)
    return result


def structured(result: Any) -> Any:
    ok(result)
    if result.structured_content is not None:
        return result.structured_content
    return json.loads(text_of(result))


def sandbox_exists(server: CladeServer, sandbox_id: str, key: str) -> bool:
    status, _ = server.api("GET", f"/v1/sandboxes/{sandbox_id}", key)
    assert status in (200, 404), status
    return status == 200


async def test_the_tools_are_listed_with_precise_schemas(server, transport):
    async with connect(transport, server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert EXPECTED_TOOLS <= set(tools), sorted(tools)
        run = tools["run_command"].input_schema
        assert run["type"] == "object" and set(run["required"]) == {"sandbox_id", "command"}
        assert "timeout_seconds" in run["properties"] and run.get("additionalProperties") is False
        write = json.dumps(tools["write_file"].input_schema)
        assert "base64" in write and "utf8" in write
        create = json.dumps(tools["create_sandbox"].input_schema)
        for field in ("template", "network", "allow_domains", "allow_cidrs", "internet", "metadata", "persistent"):
            assert field in create, field
        assert all(len(tool.description or "") > 30 for tool in tools.values())


async def test_a_session_runs_commands_moves_files_forks_and_takes_its_sandboxes_with_it(server, transport):
    key = server.admin_key
    async with connect(transport, server) as client:
        made = structured(await client.call_tool("create_sandbox", {"metadata": {"test": "mcp"}}))
        sandbox = made["id"]
        assert made["deleted_when_session_ends"] is True
        assert made["metadata"]["test"] == "mcp" and made["metadata"]["mcp_session"]
        kept = structured(await client.call_tool("create_sandbox", {"persistent": True}))
        assert kept["deleted_when_session_ends"] is False

        answer = text_of(ok(await client.call_tool("run_command", {"sandbox_id": sandbox, "command": "python3 -c 'print(6*7)'"})))
        assert "exit code: 0" in answer and "42" in answer, answer

        # With a progressToken, output arrives as progress notifications while the command runs.
        seen: List[str] = []

        async def on_progress(progress: float, total: Any, message: Any) -> None:
            seen.append(message or "")

        streamed = text_of(ok(await client.call_tool(
            "run_command", {"sandbox_id": sandbox, "command": "echo one; sleep 0.3; echo two >&2; exit 3"},
            progress_callback=on_progress)))
        assert "exit code: 3" in streamed and "one" in streamed and "two" in streamed, streamed
        assert any("one" in m for m in seen) and any("two" in m for m in seen), seen

        # Long output keeps its tail and says what it dropped.
        long = text_of(ok(await client.call_tool(
            "run_command", {"sandbox_id": sandbox, "command": "python3 -c \"print('x' * 50000 + 'END')\""})))
        assert "earlier characters of stdout dropped" in long and "END" in long

        blob = bytes(range(256)) * 4
        ok(await client.call_tool("write_file", {"sandbox_id": sandbox, "path": "/tmp/data.bin",
                                                 "content": base64.b64encode(blob).decode(), "encoding": "base64"}))
        read = ok(await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "/tmp/data.bin"}))
        texts = [item.text for item in read.content if item.type == "text"]
        assert "base64" in texts[0], texts[0]
        assert base64.b64decode(texts[-1]) == blob
        ok(await client.call_tool("write_file", {"sandbox_id": sandbox, "path": "/tmp/notes/hello.txt", "content": "héllo\n"}))
        assert text_of(ok(await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "/tmp/notes/hello.txt"}))) == "héllo\n"
        listing = text_of(ok(await client.call_tool("list_files", {"sandbox_id": sandbox, "path": "/tmp"})))
        assert "data.bin" in listing and "notes/" in listing, listing

        # Files and templates as resources.
        templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates]
        assert "clade://sandboxes/{id}/files/{path}" in templates
        as_text = (await client.read_resource(f"clade://sandboxes/{sandbox}/files/tmp/notes/hello.txt")).contents[0]
        assert as_text.text == "héllo\n"
        as_blob = (await client.read_resource(f"clade://sandboxes/{sandbox}/files/tmp/data.bin")).contents[0]
        assert base64.b64decode(as_blob.blob) == blob
        assert "clade://templates" in [str(r.uri) for r in (await client.list_resources()).resources]
        listed = json.loads((await client.read_resource("clade://templates")).contents[0].text)
        assert "base" in [t["name"] for t in listed]

        port = structured(await client.call_tool("expose_port", {"sandbox_id": sandbox, "port": 8000, "label": "web"}))
        assert f"8000-{sandbox}" in port["preview_url"] and port["proxy_url"].endswith(f"/v1/sandboxes/{sandbox}/proxy/8000/")

        # Fork into two, promote one: its sibling goes.
        ok(await client.call_tool("write_file", {"sandbox_id": sandbox, "path": "/tmp/state", "content": "parent"}))
        forked = structured(await client.call_tool("fork_sandbox", {"sandbox_id": sandbox, "count": 2}))
        children = [c["id"] for c in forked["children"]]
        assert len(children) == 2 and all(c["deleted_when_session_ends"] for c in forked["children"])
        for child in children:
            assert text_of(ok(await client.call_tool("read_file", {"sandbox_id": child, "path": "/tmp/state"}))) == "parent"
        promoted = structured(await client.call_tool("promote_sandbox", {"sandbox_id": children[0]}))
        assert promoted["winner"] == children[0] and children[1] in promoted["deleted"], promoted
        assert not sandbox_exists(server, children[1], key)

        listed_sandboxes = structured(await client.call_tool("list_sandboxes", {}))["sandboxes"]
        assert {sandbox, kept["id"], children[0]} <= {s["id"] for s in listed_sandboxes}

    # The session ended: its sandboxes went with it, but the persistent one.
    for gone in (sandbox, children[0]):
        wait_for(lambda: not sandbox_exists(server, gone, key), timeout=60, what=f"{gone} deleted with its session")
    assert sandbox_exists(server, kept["id"], key)
    status, _ = server.api("DELETE", f"/v1/sandboxes/{kept['id']}", key)
    assert status == 204


@pytest.fixture(scope="module")
def foreign_sandbox(server, other_key):
    """A sandbox of workspace `other`."""
    status, made = server.api("POST", "/v1/sandboxes", other_key, body={})
    assert status == 201, made
    yield made["id"]
    server.api("DELETE", f"/v1/sandboxes/{made['id']}", other_key)


async def test_unknown_and_foreign_sandboxes_are_tool_errors(server, transport, foreign_sandbox):
    async with connect(transport, server) as client:
        for sandbox in ("sb-does-not-exist", foreign_sandbox):
            result = await client.call_tool("run_command", {"sandbox_id": sandbox, "command": "true"})
            assert result.is_error, text_of(result)
            assert "not found" in text_of(result) and "404" in text_of(result), text_of(result)
            result = await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "/etc/hostname"})
            assert result.is_error and "not found" in text_of(result)
        # Arguments that do not fit the schema are a tool error too.
        result = await client.call_tool("run_command", {"sandbox_id": "x"})
        assert result.is_error and "command" in text_of(result)
        # The session still works after its errors.
        assert "sandboxes" in structured(await client.call_tool("list_sandboxes", {}))
    assert sandbox_exists(server, foreign_sandbox, server.keys[1])


@pytest.fixture(scope="module")
def code_interpreter(server) -> str:
    """The code-interpreter template, built if needed (cached under /var/cache/clade)."""
    out = subprocess.run([str(BIN), "images", "build", "--image", "code-interpreter"], capture_output=True, text=True,
                         env=server.env, timeout=1800)
    if out.returncode != 0:
        skip_or_fail(f"the code-interpreter template cannot be built:\n{out.stderr[-2000:]}")
    return "code-interpreter"


async def test_a_code_cell_keeps_state_and_returns_a_chart_as_an_image(server, transport, code_interpreter):
    async with connect(transport, server) as client:
        sandbox = structured(await client.call_tool("create_sandbox", {"template": code_interpreter}))["id"]
        first = ok(await client.call_tool("run_code", {"sandbox_id": sandbox, "code": "x = 41\nx + 1"}))
        assert "42" in text_of(first), text_of(first)
        context = text_of(first).split("context_id: ", 1)[1].split()[0]
        chart = ok(await client.call_tool("run_code", {
            "sandbox_id": sandbox, "context_id": context,
            "code": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, x])\nplt.show()"}))
        images = [item for item in chart.content if item.type == "image"]
        assert images and images[0].mime_type == "image/png", text_of(chart)
        assert base64.b64decode(images[0].data)[:8] == b"\x89PNG\r\n\x1a\n"
        raised = ok(await client.call_tool("run_code", {"sandbox_id": sandbox, "context_id": context, "code": "1/0"}))
        assert "ZeroDivisionError" in text_of(raised)
    wait_for(lambda: not sandbox_exists(server, sandbox, server.admin_key), timeout=60, what="the cell's sandbox deleted")


def test_http_needs_a_valid_key(server):
    for path in ("/mcp", "/v1/mcp"):
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        headers = {"Accept": "application/json, text/event-stream"}
        for key in (None, "clade_not_a_key"):
            status, body = server.api("POST", path, key, body=initialize, headers=headers)
            assert status == 401, (path, key, status, body)
            assert body["error"] == "unauthorized" and body["request_id"], body


async def test_snapshot_hibernate_and_wake(server):
    # The tools are the same on both transports; one is enough here.
    async with connect("http", server) as client:
        sandbox = structured(await client.call_tool("create_sandbox", {}))["id"]
        ok(await client.call_tool("write_file", {"sandbox_id": sandbox, "path": "/home/user/kept.txt", "content": "kept"}))
        name = f"mcp-{uuid.uuid4().hex[:8]}"
        taken = structured(await client.call_tool("snapshot_sandbox", {"sandbox_id": sandbox, "name": name}))
        assert taken["name"] == name, taken
        snapshot = taken["snapshot_id"]
        # The name starts a sandbox as the id does.
        restored = structured(await client.call_tool("create_sandbox", {"from_snapshot": name}))["id"]
        assert text_of(ok(await client.call_tool("read_file", {"sandbox_id": restored, "path": "/home/user/kept.txt"}))) == "kept"
        assert structured(await client.call_tool("hibernate_sandbox", {"sandbox_id": sandbox}))["status"] == "hibernated"
        assert structured(await client.call_tool("wake_sandbox", {"sandbox_id": sandbox}))["status"] == "running"
        assert text_of(ok(await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "/home/user/kept.txt"}))) == "kept"
        # Disk only: the wake boots the disk, the file stays.
        boot_id = "/proc/sys/kernel/random/boot_id"
        booted = text_of(ok(await client.call_tool("read_file", {"sandbox_id": sandbox, "path": boot_id})))
        hibernated = structured(await client.call_tool("hibernate_sandbox", {"sandbox_id": sandbox, "memory": False}))
        assert hibernated["status"] == "hibernated"
        assert structured(await client.call_tool("wake_sandbox", {"sandbox_id": sandbox}))["status"] == "running"
        assert text_of(ok(await client.call_tool("read_file", {"sandbox_id": sandbox, "path": boot_id}))) != booted
        assert text_of(ok(await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "/home/user/kept.txt"}))) == "kept"
    for gone in (sandbox, restored):
        wait_for(lambda: not sandbox_exists(server, gone, server.admin_key), timeout=60, what=f"{gone} deleted with its session")
    server.api("DELETE", f"/v1/snapshots/{snapshot}", server.admin_key)
