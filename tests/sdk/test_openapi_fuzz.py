"""A property-based run of the whole API: schemathesis generates requests
from the committed OpenAPI document (docs/openapi.json) and sends them to a
dedicated `clade server` with real VMs, authenticated with its admin key.

Checks (tests/sdk/openapi_fuzz_hooks.py):
- no server error: every 5xx fails the run, except the refusals the API
  documents: 503 from the scheduler with Retry-After, 507 from host
  admission, and a 504 for a command that outran its timeout;
- response schema conformance: a documented status answers with the
  documented body.

It prints how many test cases it generated and every status it received
(the count goes in the notes). Bounded for a 2-core TCG host: FUZZ_EXAMPLES cases per operation (default
20; about 1300 requests, 1.5 min here), one worker at 20 requests/s, and `--max-running 1` with one real sandbox already
running, so random creates and forks are refused (503) instead of booting
VMs. The hooks point most sandbox-scoped requests at that sandbox so they
reach real handlers. The command line of the run is printed; `--seed`
replays one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import REPO, TEMPLATE, skip_or_fail

DOCUMENT = REPO / "docs" / "openapi.json"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))
SEED = os.environ.get("FUZZ_SEED", "20261202")


def schemathesis_bin() -> Path:
    return Path(sys.executable).with_name("schemathesis")


@pytest.mark.timeout(900)
def test_schemathesis_finds_no_server_error(start_server, tmp_path):
    if not schemathesis_bin().is_file():
        skip_or_fail(f"schemathesis is not installed next to {sys.executable} (scripts/install-sdk-deps)")
    server = start_server("fuzz", args=["--max-running", "1"])
    sandbox = server.client().sandboxes.create(template=TEMPLATE, ttl_seconds=3600)
    me = requests.get(f"{server.url}/v1/me", headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=30).json()
    cmd = [
        str(schemathesis_bin()), "run", str(DOCUMENT),
        "--url", server.url,
        "--header", f"Authorization: Bearer {server.admin_key}",
        "--checks", "no_undocumented_server_error,response_schema_conformance",
        "--max-examples", str(EXAMPLES),
        "--phases", "examples,coverage,fuzzing",
        "--workers", "1",
        # Under the server's rate limit (25/s per workspace): 429s reach no handler.
        "--rate-limit", "20/s",
        "--seed", SEED,
        "--request-timeout", "120",
        "--suppress-health-check", "all",
        "--report", "junit,json",
        "--report-dir", str(tmp_path / "report"),
        "--report-json-path", str(tmp_path / "report" / "run.json"),
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "openapi_fuzz_hooks",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        "CLADE_FUZZ_SANDBOX": sandbox.id,
        "CLADE_FUZZ_ADMIN_PREFIX": me["key"]["prefix"],
        "CLADE_FUZZ_STATS": str(tmp_path / "statuses.json"),
        "NO_COLOR": "1",
    }
    started = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=840, cwd=tmp_path)
    elapsed = time.monotonic() - started
    printable = [c if not c.startswith("Authorization:") else "Authorization: Bearer <admin key>" for c in cmd]
    print(f"\n$ {' '.join(printable)}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}\nschemathesis ran {elapsed:.0f} s")
    assert run.returncode == 0, f"schemathesis found failures (exit {run.returncode}):\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}"
    # What the run tried, and what it got: the figure the issue asks to report.
    cases = json.loads((tmp_path / "report" / "run.json").read_text())["test_cases"]
    statuses = {int(k): v for k, v in json.loads((tmp_path / "statuses.json").read_text()).items()}
    server_errors = {status: n for status, n in statuses.items() if status >= 500}
    print(f"schemathesis: {cases['generated']} test cases, {sum(statuses.values())} responses "
          f"({', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))}); "
          f"5xx all documented refusals: {server_errors or 'none'}; cases with failures: {cases['with_failures']}")
    assert cases["generated"] > 0 and cases["with_failures"] == 0, cases
    # The seeded sandbox took the requests: the server is still sound.
    assert server.alive(), "the server died during the run"
