"""Runs the E2B JS compatibility suite (tests/e2b-js, `node --test`) against
one real `clade server`: what tests/e2b/conftest.py does for the Python
SDKs, for the unmodified E2B JS SDKs. Started by scripts/test-e2b-js, which
installs the SDKs first and passes their node_modules in
`E2B_JS_NODE_MODULES`; arguments go to `node --test`.

It starts the built binary (`CLADE_BIN`, default target/release/clade) with
tests/harness/clade_harness.py's `CladeServer`, makes an E2B key of
workspace `e2b` and one of workspace `other`, and runs the suite's test
files (in a temporary copy beside a link to node_modules: Node resolves
`import 'e2b'` from where a file is) with the SDKs pointed at the server
the way an E2B user would point them at a self-hosted E2B: `E2B_API_URL`
and `E2B_SANDBOX_URL` at it, `E2B_API_KEY` a Clade key in E2B's form. Then
it tears the server down: the sandboxes left deleted, the server stopped,
VMs left behind killed. On a failure the tail of the server's log follows
the test output.

Without root, QEMU or the binary the suite is skipped with the reason
(exit 0), but fails when `CI` is set.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import types
import uuid
from pathlib import Path
from typing import List

SUITE = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE.parent / "harness"))
try:
    import pytest  # noqa: F401 (the harness imports it; only its skip_or_fail uses it)
except ImportError:
    # The harness is the Python suites'; this launcher uses none of its
    # pytest parts, and Debian's python3 has no pytest.
    sys.modules["pytest"] = types.ModuleType("pytest")
from clade_harness import CladeServer, in_ci, missing_requirement  # noqa: E402

# What the SDKs read from the environment: only what this sets counts.
E2B_VARIABLES = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN",
                 "E2B_USER_AGENT_SOURCE")


def e2b_key(server: CladeServer, workspace: str) -> str:
    """A key of `workspace` in E2B's form (`e2b_` and 40 hex digits)."""
    command = [str(server.bin), "keys", "create", "--format", "e2b", "--workspace", workspace,
               "--data-dir", str(server.data_dir)]
    out = subprocess.run(command, capture_output=True, text=True, env=server.env, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"clade keys create --format e2b failed:\n{out.stderr}")
    key = out.stdout.strip().splitlines()[-1].strip()
    if not re.fullmatch(r"e2b_[0-9a-f]{40}", key):
        raise RuntimeError(f"not an E2B key: {key!r}")
    server.keys.append(key)
    return key


def node_arguments(args: List[str], work: Path) -> List[str]:
    """`node --test` options and files: a file of the suite given (as
    tests/e2b-js/x.test.mjs, or x.test.mjs) is its copy, and all the
    suite's files when none is. node --test runs them one at a time
    (--test-concurrency=1: each makes VMs) in the order of their names,
    whatever the order given: their numbers put the control plane first,
    then envd, the lifecycle, and the interpreter (whose image may need
    building) last."""
    options: List[str] = []
    files: List[str] = []
    for arg in args:
        if not arg.startswith("-") and arg.endswith(".mjs"):
            copy = work / Path(arg).name
            if not copy.is_file():
                raise SystemExit(f"run.py: no test file {arg} in {SUITE}")
            files.append(str(copy))
        else:
            options.append(arg)
    return options + (files or sorted(str(path) for path in work.glob("*.test.mjs")))


def terminate(signum: int, _frame: object) -> None:
    # Through the finally blocks: the server and its VMs go too.
    raise SystemExit(128 + signum)


def main(args: List[str]) -> int:
    reason = missing_requirement("the E2B JS suite")
    if reason:
        if in_ci():
            print(f"test-e2b-js: required in CI: {reason}", file=sys.stderr)
            return 1
        print(f"test-e2b-js: skipped: {reason}", file=sys.stderr)
        return 0
    if not os.environ.get("E2B_JS_NODE_MODULES"):
        print("test-e2b-js: E2B_JS_NODE_MODULES is not set: run the suite with scripts/test-e2b-js", file=sys.stderr)
        return 2
    modules = Path(os.environ["E2B_JS_NODE_MODULES"])
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)

    work = Path(tempfile.mkdtemp(prefix="clade-e2b-js-"))
    server = None
    try:
        for path in SUITE.iterdir():
            if path.suffix in (".mjs", ".json"):
                shutil.copy2(path, work / path.name)
        (work / "node_modules").symlink_to(modules)
        command = ["node", "--test", "--test-concurrency=1", *node_arguments(args, work)]
        if not any(arg.startswith("--test-reporter") for arg in args):
            command.insert(2, "--test-reporter=spec")

        server = CladeServer("e2b-js", args=["--standby-horizon", "30"]).start()
        # The server's environment (its CLADE_GUESTD too: the code-interpreter
        # test builds that image the way the server would).
        env = {name: value for name, value in server.env.items() if name not in E2B_VARIABLES}
        env.update(
            E2B_API_URL=server.url,
            E2B_SANDBOX_URL=server.url,
            E2B_API_KEY=e2b_key(server, "e2b"),
            # For the isolation test: a key of another workspace of the same server.
            E2B_JS_OTHER_API_KEY=e2b_key(server, "other"),
            # Tags every sandbox of this run (metadata `run`).
            E2B_JS_RUN=uuid.uuid4().hex[:12],
            CLADE_BIN=str(server.bin),
        )
        print(f"test-e2b-js: server {server.url} ({server.log_path})", file=sys.stderr)
        rc = subprocess.run(command, cwd=work, env=env).returncode
        if rc != 0:
            print(f"\n--- clade server log ({server.log_path}), last lines:\n{server.log_tail(80)}", file=sys.stderr)
        return rc
    finally:
        if server is not None:
            server.teardown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
