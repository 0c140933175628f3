"""Functions' figures (issue 34), against a `clade server` of its own
(CLADE_BIN, default target/release/clade) with real VMs, through the HTTP
API:

- deploy: `POST /v1/functions` with code → `ready` (a sandbox of the
  template, the code written in, a snapshot);
- invoke: `POST …/invoke` → the finished run, `--invokes` times in a row
  (each restores the snapshot, runs the handler, answers; the sandbox is
  deleted after the answer): p50, p99, and the run's own `duration_ms`;
- the same through the public function's host (`--http` times);
- the baseline: what a client does without functions, a sandbox create
  from the same template, then an exec of the same Python, then a delete.

Prints medians and ratios for docs/benchmarks.md (`bench/functions`).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from clade_harness import CladeServer  # noqa: E402

HANDLER = "def handler(event):\n    return {'echo': event}\n"
TEMPLATE = "code-interpreter"


def percentile(values, p: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 1))))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--invokes", type=int, default=30)
    parser.add_argument("--http", type=int, default=10)
    args = parser.parse_args()
    server = CladeServer("fn-bench", args=["--standby-horizon", "30"]).start()
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {server.admin_key}"

    def call(method: str, path: str, **kwargs):
        answer = session.request(method, f"{server.url}{path}", timeout=900, **kwargs)
        if answer.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text}")
        return answer.json() if answer.content else None

    figures: dict = {}
    try:
        # The template's first use bakes it: paid once, not measured.
        warm = call("POST", "/v1/sandboxes", json={"template": TEMPLATE})
        call("DELETE", f"/v1/sandboxes/{warm['id']}")

        code = base64.b64encode(HANDLER.encode()).decode()
        started = time.monotonic()
        fn = call("POST", "/v1/functions", json={"name": "bench", "runtime": "python", "code": code, "public": True, "template": TEMPLATE})
        while (info := call("GET", f"/v1/functions/{fn['id']}"))["status"] == "deploying":
            time.sleep(0.05)
        if info["status"] != "ready":
            raise RuntimeError(f"deploy failed: {info}")
        figures["deploy → ready"] = time.monotonic() - started

        invokes, durations = [], []
        for i in range(args.invokes):
            started = time.monotonic()
            run = call("POST", f"/v1/functions/{fn['id']}/invoke", json={"input": {"i": i}})
            invokes.append(time.monotonic() - started)
            if run["status"] != "success" or run["output"] != {"echo": {"i": i}}:
                raise RuntimeError(f"a run failed: {run}")
            durations.append(run["duration_ms"] / 1000)
        figures["invoke → run, p50"] = statistics.median(invokes)
        figures["invoke → run, p99"] = percentile(invokes, 0.99)
        figures["run's own duration_ms, p50"] = statistics.median(durations)

        host = f"{fn['id']}.localhost:{server.port}"
        http = []
        for i in range(args.http):
            started = time.monotonic()
            answer = requests.post(f"{server.url}/", json={"i": i}, headers={"Host": host}, timeout=900)
            http.append(time.monotonic() - started)
            if answer.status_code != 200:
                raise RuntimeError(f"public request: {answer.status_code} {answer.text}")
        figures["public host request → answer, p50"] = statistics.median(http)

        baseline = []
        script = "import json; print(json.dumps({'echo': {'i': 1}}))"
        for _ in range(max(5, args.invokes // 3)):
            started = time.monotonic()
            sandbox = call("POST", "/v1/sandboxes", json={"template": TEMPLATE})
            out = call("POST", f"/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": f"python3 -c \"{script}\""})
            baseline.append(time.monotonic() - started)
            call("DELETE", f"/v1/sandboxes/{sandbox['id']}")
            if out["exit_code"] != 0:
                raise RuntimeError(f"baseline exec failed: {out}")
        figures["baseline: create + exec python3, p50"] = statistics.median(baseline)
        figures["invoke p50 / baseline p50"] = figures["invoke → run, p50"] / figures["baseline: create + exec python3, p50"]
        call("DELETE", f"/v1/functions/{fn['id']}")
    finally:
        server.teardown()
    width = max(len(name) for name in figures)
    for name, value in figures.items():
        shown = f"{value:.2f}×" if name.startswith("invoke p50 /") else (f"{value:.1f} s" if value >= 10 else ms(value))
        print(f"{name:<{width}}  {shown}")
    print(json.dumps({name: round(value, 4) for name, value in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
