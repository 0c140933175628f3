"""The unmodified PandaStack TypeScript SDK (`@pandastack/sdk`, pinned in
tests/sdk/ts/package-lock.json, installed by scripts/install-sdk-deps): a
create that names no template asks for `ubuntu-24.04`, an alias of `base`,
and works out of the box (issue 27)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from conftest import skip_or_fail

SCRIPT = Path(__file__).resolve().parent / "ts" / "default_create.cjs"


def test_a_typescript_sdk_create_with_no_template_runs_base(server):
    modules = os.environ.get("CLADE_SDK_NODE_MODULES", "/var/cache/clade/sdk-node/node_modules")
    if shutil.which("node") is None or not Path(modules, "@pandastack", "sdk").is_dir():
        skip_or_fail(f"node or the TypeScript SDK in {modules} is missing (scripts/install-sdk-deps)")
    env = {**os.environ, "CLADE_SDK_NODE_MODULES": modules, "PANDASTACK_API_URL": server.url,
           "PANDASTACK_API_KEY": server.admin_key}
    out = subprocess.run(["node", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"template": "base", "stdout": "debian\n", "exitCode": 0}, result
