"""Apps' figures (issue 34), against a `clade server` of its own (CLADE_BIN,
default target/release/clade, with --apps-allow-file-urls) with real VMs,
through the HTTP API. The app is a stdlib Python web server in a `file://`
repository made here (detected as `python`: nothing to install).

- deploy → live: `POST …/deploys` until the deployment is `live` (fetch,
  a sandbox of `base`, the source unpacked, the process started, its port
  answering), for the first deployment and for a second commit;
- a request through the app's host name (`{name}.localhost`), `--requests`
  times: p50, p99; against the same request through the sandbox's preview
  host (what the app's host name adds);
- rollback → the old deployment answers: `POST …/rollback` until a request
  gets the old version (the kept deployment is hibernated: a switch and a
  wake), `--rollbacks` times, going back and forth by redeploying;
- wake: an `auto_hibernate` app left idle until it hibernates, then a
  request until it answers, `--wakes` times.

Prints medians and ratios for docs/benchmarks.md (`bench/apps`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from clade_harness import CladeServer  # noqa: E402

SERVER = """\
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"version": %d}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), Handler).serve_forever()
"""


def percentile(values, p: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 1))))
    return ordered[rank - 1]


def git(repo: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b",
           "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def commit(repo: Path, version: int) -> None:
    (repo / "server.py").write_text(SERVER % version)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"v{version}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rollbacks", type=int, default=5)
    parser.add_argument("--wakes", type=int, default=5)
    args = parser.parse_args()
    server = CladeServer("app-bench", args=["--standby-horizon", "30", "--apps-allow-file-urls"]).start()
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {server.admin_key}"
    repo = Path(tempfile.mkdtemp(prefix="clade-app-bench-"))
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    version = 1
    commit(repo, version)

    def call(method: str, path: str, **kwargs):
        answer = session.request(method, f"{server.url}{path}", timeout=900, **kwargs)
        if answer.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text}")
        return answer.json() if answer.content else None

    def deploy(app_id: str) -> float:
        started = time.monotonic()
        deployment = call("POST", f"/v1/apps/{app_id}/deploys")
        while (info := call("GET", f"/v1/apps/{app_id}/deploys/{deployment['id']}"))["status"] not in ("live", "failed"):
            time.sleep(0.05)
        if info["status"] != "live":
            raise RuntimeError(f"deployment failed: {info['error']}\n{info['build_logs'][-2000:]}")
        return time.monotonic() - started

    def get(host: str) -> dict:
        answer = requests.get(f"{server.url}/", headers={"Host": f"{host}:{server.port}"}, timeout=300)
        if answer.status_code != 200:
            raise RuntimeError(f"{host}: {answer.status_code} {answer.text}")
        return answer.json()

    figures: dict = {}
    try:
        # base's first use bakes its template: paid once, not measured.
        warm = call("POST", "/v1/sandboxes", json={"template": "base"})
        call("DELETE", f"/v1/sandboxes/{warm['id']}")
        app = call("POST", "/v1/apps", json={"name": "bench", "git_url": f"file://{repo}", "port": 8080})
        figures["first deploy → live"] = deploy(app["id"])
        version += 1
        commit(repo, version)
        figures["second deploy → live"] = deploy(app["id"])

        sandbox = call("GET", f"/v1/apps/{app['id']}")["sandbox_id"]
        through_app, through_preview = [], []
        for _ in range(args.requests):
            for host, times in ((f"bench.localhost", through_app), (f"8080-{sandbox}.localhost", through_preview)):
                started = time.monotonic()
                get(host)
                times.append(time.monotonic() - started)
        figures["request via the app's host, p50"] = statistics.median(through_app)
        figures["request via the app's host, p99"] = percentile(through_app, 0.99)
        figures["request via the preview host, p50"] = statistics.median(through_preview)
        figures["app host ÷ preview host"] = figures["request via the app's host, p50"] / figures["request via the preview host, p50"]

        rollbacks = []
        for _ in range(args.rollbacks):
            # Let the sweep hibernate the kept deployment first, as it would be.
            time.sleep(12)
            before = get("bench.localhost")["version"]
            started = time.monotonic()
            call("POST", f"/v1/apps/{app['id']}/rollback")
            while get("bench.localhost")["version"] == before:
                time.sleep(0.02)
            rollbacks.append(time.monotonic() - started)
            version += 1
            commit(repo, version)
            deploy(app["id"])
        figures["rollback → the old version answers, p50"] = statistics.median(rollbacks)
        figures["rollback → the old version answers, max"] = max(rollbacks)

        napper = call("POST", "/v1/apps", json={"name": "napper", "git_url": f"file://{repo}", "port": 8080,
                                                 "auto_hibernate": True, "idle_timeout_seconds": 10})
        deploy(napper["id"])
        wakes = []
        for _ in range(args.wakes):
            sandbox = call("GET", f"/v1/apps/{napper['id']}")["sandbox_id"]
            while call("GET", f"/v1/sandboxes/{sandbox}")["status"] != "hibernated":
                time.sleep(0.5)
            started = time.monotonic()
            get("napper.localhost")
            wakes.append(time.monotonic() - started)
        figures["request to a hibernated app → answer, p50"] = statistics.median(wakes)
        figures["request to a hibernated app → answer, max"] = max(wakes)
        call("DELETE", f"/v1/apps/{app['id']}")
        call("DELETE", f"/v1/apps/{napper['id']}")
    finally:
        server.teardown()
    width = max(len(name) for name in figures)
    for name, value in figures.items():
        shown = f"{value:.2f}×" if "÷" in name else (f"{value:.1f} s" if value >= 10 else f"{value * 1000:.0f} ms")
        print(f"{name:<{width}}  {shown}")
    print(json.dumps({name: round(value, 4) for name, value in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
