"""Templates users build, through the unmodified SDK (§3.11, issue 27): a
Dockerfile whose RUN runs inside a Clade VM (a pip install from PyPI) and
whose COPY places a context file, its log streamed live, then a sandbox from
it; a rebuild that changes only the last step reruns only that step; a
failing RUN; a root filesystem tarball the test makes (busybox); the 409 and
404 cases."""

from __future__ import annotations

import io
import tarfile
import time
import uuid
from pathlib import Path

import pandastack
import pytest
import requests

from conftest import skip_or_fail

BUILD_TIMEOUT = 900

DOCKERFILE = """\
FROM base
ARG GREETING=hello
ENV APP_HOME=/app
WORKDIR $APP_HOME
COPY hello.txt ./
COPY data/ ./data/
RUN pip install --break-system-packages --no-cache-dir six==1.16.0
RUN python3 -c "import six; print(six.__version__)" > /app/six.txt && echo "$GREETING from $APP_HOME"
EXPOSE 8000
CMD ["python3", "-m", "http.server", "8000"]
"""


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def follow(client, build_id: str) -> list:
    """The build's log, read live: (seconds since the call, line) each."""
    started = time.monotonic()
    return [(time.monotonic() - started, line) for line in client.templates.build_logs(build_id, follow=True)]


def run(sb, cmd: str) -> str:
    out = sb.exec(cmd, timeout_seconds=120)
    assert out.exit_code == 0, f"{cmd}: exit {out.exit_code}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.timeout(BUILD_TIMEOUT * 2)
def test_a_dockerfile_build_runs_in_a_vm_streams_its_log_and_caches_its_steps(server, client, tmp_path):
    context = tmp_path / "ctx"
    (context / "data").mkdir(parents=True)
    (context / "hello.txt").write_text("copied from the context\n")
    (context / "data" / "numbers.csv").write_text("a,b\n1,2\n")
    name = unique("py")
    build = client.templates.build_from_dockerfile(name, DOCKERFILE, context_dir=str(context), memory_mb=768)
    assert build.status in ("queued", "running")
    lines = follow(client, build.id)
    text = "\n".join(line for _, line in lines)
    assert "step 1/" in text and "RUN pip install" in text, text
    assert "Successfully installed six" in text, text
    assert "hello from /app" in text, "ARG and ENV reached the RUN"
    # Lines came as the build went, not all at the end.
    assert lines[-1][0] - lines[0][0] > 1.0, lines[:3]
    done = client.templates.wait_for_build(build.id, timeout_seconds=BUILD_TIMEOUT)
    assert done.status == "done", done

    template = client.templates.get(name)
    assert template.is_global is False and template.base == "base"
    assert template.meta["ports"] == [8000] and template.meta["start_command"] == ["python3", "-m", "http.server", "8000"]
    sb = client.sandboxes.create(template=name)
    try:
        assert sb.template == name
        assert run(sb, "cat /app/hello.txt") == "copied from the context\n"
        assert run(sb, "cat /app/data/numbers.csv") == "a,b\n1,2\n"
        assert run(sb, "cat /app/six.txt") == "1.16.0\n"
        assert run(sb, "python3 -c 'import six; print(six.PY3)'") == "True\n"
        # The Dockerfile's ENV and WORKDIR are every command's defaults.
        assert run(sb, "echo $APP_HOME; pwd; cat hello.txt") == "/app\n/app\ncopied from the context\n"
    finally:
        sb.kill()

    # Only the last step changed: every step before it comes from the cache.
    changed = DOCKERFILE.replace("EXPOSE 8000", "RUN echo changed > /app/last.txt\nEXPOSE 8000")
    # The name is taken: the SDK's call (which cannot say replace) is refused, 409...
    with pytest.raises(pandastack.BadRequestError):
        client.templates.build_from_dockerfile(name, changed, context_dir=str(context))
    # ...and the API's replace=true (§3.11) rebuilds it, the workspace's own.
    started = time.monotonic()
    files = {path: (path, (context / path).read_bytes()) for path in ["hello.txt", "data/numbers.csv"]}
    reply = requests.post(f"{server.url}/v1/templates/build", headers={"Authorization": f"Bearer {server.admin_key}"},
                          data={"name": name, "dockerfile": changed, "memory_mb": "768", "replace": "true"}, files=files,
                          timeout=60)
    assert reply.status_code == 202, reply.text
    rebuild = client.templates.get_build(reply.json()["id"])
    relog = "\n".join(line for _, line in follow(client, rebuild.id))
    assert client.templates.wait_for_build(rebuild.id, timeout_seconds=BUILD_TIMEOUT).status == "done"
    print(f"rebuild with its last step changed: {time.monotonic() - started:.1f} s")
    assert "cached" in relog and "Successfully installed six" not in relog, relog
    sb = client.sandboxes.create(template=name)
    try:
        assert run(sb, "cat /app/last.txt") == "changed\n"
        assert run(sb, "cat /app/six.txt") == "1.16.0\n"
    finally:
        sb.kill()
    client.templates.delete(name)
    with pytest.raises(pandastack.NotFoundError):
        client.templates.get(name)


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_a_failing_run_fails_the_build_with_its_exit_code_and_output(client):
    name = unique("broken")
    build = client.templates.build_from_dockerfile(name, "FROM base\nRUN echo about to fail >&2; exit 3\n")
    lines = [line for _, line in follow(client, build.id)]
    ended = client.templates.get_build(build.id)
    assert ended.status == "failed"
    assert "exited 3" in (ended.error or "") and "about to fail" in (ended.error or ""), ended
    assert any("about to fail" in line for line in lines), lines
    with pytest.raises(pandastack.NotFoundError):
        client.templates.get(name)


def busybox_rootfs(path: Path) -> None:
    """A root filesystem of busybox alone, with a file to find."""
    busybox = Path("/bin/busybox")
    if not busybox.is_file():
        skip_or_fail("/bin/busybox is missing (busybox-static: scripts/install-host-deps)")
    with tarfile.open(path, "w") as tar:
        for directory in ["bin", "etc", "tmp", "root", "proc", "sys", "dev", "run"]:
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        tar.add(str(busybox), arcname="bin/busybox")
        for applet in ["sh", "cat", "echo", "ls", "true", "id"]:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for name, text in [("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n"),
                           ("hello", "from a tarball\n")]:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_a_root_filesystem_tarball_becomes_a_template(client, other_client, tmp_path):
    tarball = tmp_path / "rootfs.tar"
    busybox_rootfs(tarball)
    name = unique("tiny")
    build = client.templates.build(name, rootfs_tar=str(tarball), size_mb=512, timeout_seconds=BUILD_TIMEOUT)
    assert build.status == "done", build
    # Another workspace does not see it.
    with pytest.raises(pandastack.NotFoundError):
        other_client.templates.get(name)
    assert name not in [t.name for t in other_client.templates.list()]
    sb = client.sandboxes.create(template=name)
    try:
        assert run(sb, "cat /hello") == "from a tarball\n"
    finally:
        sb.kill()
    client.templates.delete(name)


def test_build_requests_are_checked(client):
    with pytest.raises(pandastack.BadRequestError):
        client.templates.build_from_dockerfile("Bad Name", "FROM base\n")
    with pytest.raises(pandastack.BadRequestError):
        client.templates.build_from_dockerfile("base", "FROM base\n")  # a global template's name: 409
    with pytest.raises(pandastack.BadRequestError):
        client.templates.build_from_dockerfile(unique("x"), "FROM base\nHEALTHCHECK CMD true\n")
    with pytest.raises(pandastack.BadRequestError):
        client.templates.build_from_dockerfile(unique("x"), "FROM base\n", size_mb=999999)
    with pytest.raises(pandastack.NotFoundError):
        client.templates.get_build("bld_0000000000000000")
