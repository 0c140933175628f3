"""First-party templates through the unmodified SDK (§3.11): a create that
names no template (the SDK asks for `code-interpreter`) gets Python's data
stack and a Jupyter kernel that starts; `agent` has what coding agents run;
the list, get and delete answers. The images are built here if the run has
not built them yet (`clade images build`, which waits for a build that
scripts/test started in the background)."""

from __future__ import annotations

import subprocess

import pandastack
import pytest

from conftest import BIN

# A first-party image from a warm cache is instant; from nothing, minutes.
IMAGE_BUILD_TIMEOUT = 1800


def built(server, image: str) -> None:
    """The first-party image built, and its template's snapshot baked on this
    server. A server's first create of a template boots and warms the VM it
    snapshots: tens of seconds for these images under TCG, past the SDK's
    30 s read timeout, so that create is made here with a longer one."""
    out = subprocess.run([str(BIN), "images", "build", "--image", image], capture_output=True, text=True,
                         env=server.env, timeout=IMAGE_BUILD_TIMEOUT)
    assert out.returncode == 0, f"clade images build --image {image}:\n{out.stderr[-3000:]}"
    server.client(timeout=IMAGE_BUILD_TIMEOUT).sandboxes.create(template=image).kill()


def run(sb, cmd: str) -> str:
    out = sb.exec(cmd, timeout_seconds=120)
    assert out.exit_code == 0, f"{cmd}: exit {out.exit_code}\n{out.stdout}\n{out.stderr}"
    return out.stdout


# The kernel code contexts run: started with jupyter_client, one cell
# executed, its output read from the iopub channel, then shut down.
KERNEL_ROUND_TRIP = r"""
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name="python3", startup_timeout=120)
try:
    seen = []
    kc.execute_interactive("import numpy as np; print(int(np.arange(7).sum() * 2))", timeout=120,
                           output_hook=lambda m: seen.append(m["content"].get("text", "")))
    print("".join(seen).strip())
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
"""


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)
def test_a_create_with_no_template_is_a_code_interpreter_with_its_stack_and_kernel(server, client):
    built(server, "code-interpreter")
    sb = client.sandboxes.create()
    try:
        assert sb.template == "code-interpreter"
        assert run(sb, "python3 -c 'import numpy, pandas, matplotlib, scipy, requests; print(\"ok\")'") == "ok\n"
        assert run(sb, "node --version").startswith("v")
        assert run(sb, "npm --version").strip()
        sb.filesystem.write("/tmp/kernel.py", KERNEL_ROUND_TRIP)
        assert run(sb, "python3 /tmp/kernel.py").strip().splitlines()[-1] == "42"
    finally:
        sb.kill()


@pytest.mark.timeout(IMAGE_BUILD_TIMEOUT + 600)
def test_the_agent_template_has_what_coding_agents_run(server, client):
    built(server, "agent")
    sb = client.sandboxes.create(template="agent")
    try:
        assert run(sb, "node --version").startswith("v22."), "Node.js LTS"
        for tool in ["git --version", "rg --version", "fd --version", "jq --version", "gcc --version", "make --version",
                     "python3 -m venv --help", "uv --version", "npm --version"]:
            assert run(sb, tool).strip(), tool
        # The coding agents' CLIs, on PATH for the default user.
        assert run(sb, "claude --version").strip()
        assert run(sb, "codex --version").strip()
        assert run(sb, "echo 'int main(void){return 0;}' > /tmp/b.c && gcc -o /tmp/b /tmp/b.c && /tmp/b && echo built") == "built\n"
    finally:
        sb.kill()


def test_templates_are_listed_with_their_aliases_and_global_ones_stay(client):
    listed = {t.name: t for t in client.templates.list()}
    assert {"base", "code-interpreter", "agent", "ubuntu-24.04"} <= set(listed)
    assert client.templates.get("agent").name == "agent"
    with pytest.raises(pandastack.NotFoundError):
        client.templates.get("no-such-template")
    # 403 for a global template: the SDK raises BadRequestError (§2.4).
    with pytest.raises(pandastack.BadRequestError):
        client.templates.delete("base")


def test_the_typescript_sdks_default_template_is_an_alias_of_base(client):
    sb = client.sandboxes.create(template="ubuntu-24.04")
    try:
        assert sb.template == "base"
        assert run(sb, ". /etc/os-release; echo $ID") == "debian\n"
    finally:
        sb.kill()
