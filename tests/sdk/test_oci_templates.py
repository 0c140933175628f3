"""Templates from OCI images, through the unmodified SDK (§3.11): an image the
test makes in pure Python (an OCI image layout: a busybox layer, then a
layer of whiteouts and an opaque directory, a config with Env, WorkingDir
and User) and pushes with skopeo to a local registry (`docker-registry` on
a loopback port, spoken to over plain HTTP). The template comes from that
image three ways: `register(image_ref=...)` (the server pulls it), a
`docker save`-style archive upload (docker-archive, made by skopeo) and an
OCI image layout archive upload; then a Dockerfile `FROM` the local
reference. Each template's sandboxes see the flattened layers and run
commands with the image's Env, WorkingDir and User. A pull of a tag or
repository the registry lacks fails its build naming the reference; a
reference that does not parse is refused at submission (400)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import pandastack
import pytest
import requests

from conftest import free_port, log_tail, skip_or_fail
from test_template_builds import BUILD_TIMEOUT, run, unique

REPOSITORY = "clade-test/busybox"
TAG = "v1"
# Every member of the image's layers has this modification time: the same
# layers, the same digests, on every run.
MTIME = 1_700_000_000
APP_UID = 1001

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

IMAGE_ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=from-oci"]
IMAGE_WORKDIR = "/opt/app"
IMAGE_USER = "app"

BUSYBOX_APPLETS = ["sh", "cat", "echo", "ls", "true", "id", "pwd", "env", "test"]


# --- the image, in pure Python ---------------------------------------------


class Layer:
    """One layer's tar, member by member (root-owned unless told)."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.PAX_FORMAT)

    def _info(self, name: str, kind: bytes, mode: int, uid: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = kind, mode, MTIME
        info.uid = info.gid = uid
        info.uname = info.gname = "root" if uid == 0 else ""
        return info

    def dir(self, name: str, mode: int = 0o755, uid: int = 0) -> None:
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode, uid))

    def file(self, name: str, data: bytes, mode: int = 0o644, uid: int = 0) -> None:
        info = self._info(name, tarfile.REGTYPE, mode, uid)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        info = self._info(name, tarfile.SYMTYPE, 0o777, 0)
        info.linkname = target
        self.tar.addfile(info)

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buffer.getvalue()


def base_layer() -> bytes:
    """Layer 1: a busybox root filesystem with a user `app` (1001), plus
    /etc/removed.txt and /opt/dir/{a,b} for layer 2 to remove."""
    busybox = Path("/bin/busybox")
    if not busybox.is_file():
        skip_or_fail("/bin/busybox is missing (busybox-static: scripts/install-host-deps)")
    layer = Layer()
    for directory in ["bin", "etc", "root", "proc", "sys", "dev", "run", "home", "opt", "opt/dir"]:
        layer.dir(directory)
    layer.dir("tmp", mode=0o1777)
    layer.dir("home/app", uid=APP_UID)
    layer.file("bin/busybox", busybox.read_bytes(), mode=0o755)
    for applet in BUSYBOX_APPLETS:
        layer.symlink(f"bin/{applet}", "busybox")
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001::/home/app:/bin/sh\n")
    layer.file("etc/group", b"root:x:0:\napp:x:1001:\n")
    layer.file("etc/removed.txt", b"removed by layer two\n")
    layer.file("opt/dir/a", b"a from layer one\n")
    layer.file("opt/dir/b", b"b from layer one\n")
    return layer.bytes()


def whiteout_layer() -> bytes:
    """Layer 2: a whiteout of /etc/removed.txt, /opt/dir made opaque (only
    its `c` survives), and /opt/app (the WorkingDir) owned by `app`."""
    layer = Layer()
    layer.dir("etc")
    layer.file("etc/.wh.removed.txt", b"")
    layer.dir("opt")
    layer.dir("opt/dir")
    layer.file("opt/dir/.wh..wh..opq", b"")
    layer.file("opt/dir/c", b"from layer two\n")
    layer.dir("opt/app", mode=0o755, uid=APP_UID)
    return layer.bytes()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Image:
    layout: Path  # an OCI image layout directory, its one image tagged TAG
    manifest_digest: str
    config_digest: str
    layer_digests: List[str]  # of the gzip blobs, as the manifest names them
    diff_ids: List[str]  # of the uncompressed tars, as the config names them


def write_oci_layout(layout: Path) -> Image:
    """Writes the test image as an OCI image layout directory at `layout`:
    oci-layout, index.json (the manifest tagged TAG) and blobs/sha256/."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes) -> str:
        digest = sha256(data)
        (blobs / digest.split(":", 1)[1]).write_bytes(data)
        return digest

    layers = [base_layer(), whiteout_layer()]
    diff_ids = [sha256(tar) for tar in layers]
    compressed = [gzip.compress(tar, mtime=0) for tar in layers]
    layer_digests = [blob(data) for data in compressed]
    config = {
        "created": "2023-11-14T22:13:20Z",
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": IMAGE_ENV, "WorkingDir": IMAGE_WORKDIR, "User": IMAGE_USER, "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [
            {"created": "2023-11-14T22:13:20Z", "created_by": "clade test: busybox root filesystem"},
            {"created": "2023-11-14T22:13:20Z", "created_by": "clade test: whiteouts and an opaque directory"},
        ],
    }
    config_bytes = json.dumps(config, indent=2).encode()
    config_digest = blob(config_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": [
            {"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": len(data)}
            for digest, data in zip(layer_digests, compressed)
        ],
    }
    manifest_bytes = json.dumps(manifest, indent=2).encode()
    manifest_digest = blob(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": OCI_MANIFEST,
            "digest": manifest_digest,
            "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"org.opencontainers.image.ref.name": TAG},
        }],
    }
    (layout / "index.json").write_text(json.dumps(index, indent=2))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return Image(layout, manifest_digest, config_digest, layer_digests, diff_ids)


def oci_archive(layout: Path, path: Path) -> None:
    """A tar of the layout directory itself: oci-layout, index.json and
    blobs/... at the archive's root (what `docker save` of Docker 25+ and
    `skopeo copy ... oci-archive:` make)."""
    with tarfile.open(path, "w") as tar:
        for member in ["oci-layout", "index.json", "blobs"]:
            tar.add(str(layout / member), arcname=member)


# --- skopeo and the local registry -----------------------------------------


def skopeo(*args: str, policy: Path) -> None:
    """Runs `skopeo` with an accept-anything trust policy of the test's own
    (not whatever /etc/containers/policy.json says)."""
    if shutil.which("skopeo") is None:
        skip_or_fail("skopeo is not installed (scripts/install-host-deps)")
    if not policy.exists():
        policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    out = subprocess.run(["skopeo", "--policy", str(policy), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"skopeo {' '.join(args)}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"


def docker_archive(layout: Path, path: Path, policy: Path) -> None:
    """A `docker save`-style archive (manifest.json + layer tars) of the
    layout's image, made by skopeo."""
    skopeo("copy", "--quiet", f"oci:{layout}:{TAG}", f"docker-archive:{path}:{REPOSITORY}:{TAG}", policy=policy)


class Registry:
    """`docker-registry serve` on 127.0.0.1:<free port>, its storage in a
    directory of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.log_path = root / "registry.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 30.0) -> "Registry":
        binary = shutil.which("docker-registry")
        if binary is None:
            skip_or_fail("docker-registry is not installed (scripts/install-host-deps)")
        storage = self.root / "storage"
        storage.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n"
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/v2/", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not answer /v2/ in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def ref(self, tag: str = TAG, repository: str = REPOSITORY) -> str:
        return f"{self.host}/{repository}:{tag}"

    def push(self, layout: Path, policy: Path, tag: str = TAG) -> str:
        """Pushes the layout's image (tagged TAG) as `repository:tag`; its reference."""
        ref = self.ref(tag)
        skopeo("copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:{TAG}", f"docker://{ref}", policy=policy)
        return ref

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


@dataclass
class PushedImage:
    registry: Registry
    image: Image
    ref: str  # 127.0.0.1:PORT/clade-test/busybox:v1
    policy: Path  # skopeo's trust policy file


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("oci-registry")).start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def pushed_image(registry, tmp_path_factory) -> PushedImage:
    """The test image, as a layout directory and pushed to the local registry."""
    root = tmp_path_factory.mktemp("oci-image")
    policy = root / "policy.json"
    image = write_oci_layout(root / "layout")
    ref = registry.push(image.layout, policy)
    return PushedImage(registry, image, ref, policy)


# --- the tests ---------------------------------------------------------------


def check_image_sandbox(client: pandastack.Client, template: str) -> None:
    """A sandbox of `template` sees the flattened layers (the whiteout and
    the opaque directory applied) and runs commands with the image's
    Env, WorkingDir and User."""
    sb = client.sandboxes.create(template=template)
    try:
        assert sb.template == template
        assert run(sb, "cat /opt/dir/c") == "from layer two\n"
        assert run(sb, "ls /opt/dir") == "c\n", "the opaque directory hid layer one's a and b"
        run(sb, "test ! -e /etc/removed.txt")
        assert run(sb, "echo $GREETING") == "from-oci\n"
        assert run(sb, "pwd") == IMAGE_WORKDIR + "\n"
        assert run(sb, "id -u") == f"{APP_UID}\n"
    finally:
        sb.kill()


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_a_registered_image_is_pulled_flattened_and_its_config_applies(client, other_client, pushed_image):
    name = unique("oci")
    build = client.templates.register(name, pushed_image.ref, size_mb=512)
    assert build.status in ("queued", "running"), build
    done = client.templates.wait_for_build(build.id, timeout_seconds=BUILD_TIMEOUT)
    assert done.status == "done", done
    assert done.image_ref == pushed_image.ref, done
    assert client.templates.get_build(build.id).image_ref == pushed_image.ref
    assert name in [t.name for t in client.templates.list()]
    # Another workspace does not see it.
    with pytest.raises(pandastack.NotFoundError):
        other_client.templates.get(name)
    check_image_sandbox(client, name)
    client.templates.delete(name)
    with pytest.raises(pandastack.NotFoundError):
        client.templates.get(name)


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_a_docker_save_archive_upload_is_flattened_and_its_config_applies(client, pushed_image, tmp_path):
    archive = tmp_path / "image-docker-archive.tar"
    docker_archive(pushed_image.image.layout, archive, pushed_image.policy)
    with tarfile.open(archive) as tar:
        assert "manifest.json" in tar.getnames(), tar.getnames()
    name = unique("docker-archive")
    build = client.templates.build(name, rootfs_tar=str(archive), size_mb=512, timeout_seconds=BUILD_TIMEOUT)
    assert build.status == "done", build
    check_image_sandbox(client, name)
    client.templates.delete(name)


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_an_oci_layout_archive_upload_is_flattened_and_its_config_applies(client, pushed_image, tmp_path):
    archive = tmp_path / "image-oci-layout.tar"
    oci_archive(pushed_image.image.layout, archive)
    name = unique("oci-archive")
    build = client.templates.build(name, rootfs_tar=str(archive), size_mb=512, timeout_seconds=BUILD_TIMEOUT)
    assert build.status == "done", build
    sb = client.sandboxes.create(template=name)
    try:
        assert run(sb, "cat /opt/dir/c") == "from layer two\n"
        assert run(sb, "echo $GREETING") == "from-oci\n"
    finally:
        sb.kill()
    client.templates.delete(name)


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_a_dockerfile_from_a_registry_image_runs_its_steps_in_a_vm_of_it(client, pushed_image):
    name = unique("oci-from")
    # RUN runs as the image's USER (app), in a directory layer two gave it.
    dockerfile = f"FROM {pushed_image.ref}\nRUN echo built > /opt/app/built.txt\n"
    build = client.templates.build_from_dockerfile(name, dockerfile, size_mb=512)
    assert build.status in ("queued", "running"), build
    done = client.templates.wait_for_build(build.id, timeout_seconds=BUILD_TIMEOUT)
    assert done.status == "done", done
    sb = client.sandboxes.create(template=name)
    try:
        assert run(sb, "cat built.txt") == "built\n", "relative to the image's WorkingDir"
        assert run(sb, "cat /opt/dir/c") == "from layer two\n"
        assert run(sb, "echo $GREETING") == "from-oci\n"
    finally:
        sb.kill()
    client.templates.delete(name)


def wait_for_failure(client: pandastack.Client, build_id: str) -> pandastack.templates.TemplateBuild:
    """The build's final state, which must be `failed`."""
    with pytest.raises(pandastack.TemplateBuildError) as raised:
        client.templates.wait_for_build(build_id, timeout_seconds=BUILD_TIMEOUT)
    build = raised.value.build
    assert build is not None and build.status == "failed", build
    return build


@pytest.mark.timeout(BUILD_TIMEOUT)
def test_a_pull_that_fails_fails_the_build_and_an_unparseable_reference_is_refused(client, pushed_image):
    registry = pushed_image.registry
    for ref in [registry.ref(tag="no-such-tag"), registry.ref(repository="clade-test/no-such-repo")]:
        name = unique("oci-missing")
        build = client.templates.register(name, ref, size_mb=512)
        failed = wait_for_failure(client, build.id)
        assert ref in (failed.error or ""), failed
        with pytest.raises(pandastack.NotFoundError):
            client.templates.get(name)
    with pytest.raises(pandastack.BadRequestError):
        client.templates.register(unique("oci-bad"), "UPPER CASE!!", size_mb=512)
