"""Managed PostgreSQL's figures (issue 33), against a `clade server` of its
own (CLADE_BIN, default target/release/clade) with real VMs, through the
HTTP API and a real driver (psycopg) on the connection_url it returns:

- create → first `SELECT 1` through the endpoint (the first create of a
  server bakes the template and is reported apart; then `--creates` more);
- wake on connect: an idle database hibernated, then a new connection's
  time to its first row, against a connection to a running one;
- clone: `POST …/clone` (a fork) → first `SELECT` in the clone;
- pgbench TPS inside a database (snapshot-restored, its server running
  since the template bake) against the same image booted cold from its
  disk with PostgreSQL started fresh (`/etc/clade/start`).

Prints medians and ratios for docs/benchmarks.md (`bench/databases`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

import psycopg
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from clade_harness import CladeServer  # noqa: E402


class Api:
    def __init__(self, server: CladeServer) -> None:
        self.base = server.url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {server.admin_key}"

    def call(self, method: str, path: str, **kwargs):
        answer = self.session.request(method, f"{self.base}{path}", timeout=600, **kwargs)
        if answer.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text}")
        return answer.json() if answer.content else None

    def ready(self, db_id: str) -> dict:
        while True:
            info = self.call("GET", f"/v1/databases/{db_id}")
            if info["status"] == "running" and info.get("connection_url"):
                return info
            if info["status"] == "failed":
                raise RuntimeError(f"database {db_id} failed: {info.get('error')}")
            time.sleep(0.05)

    def exec(self, sandbox: str, cmd: str, timeout_seconds: int = 600) -> dict:
        out = self.call("POST", f"/v1/sandboxes/{sandbox}/exec", json={"cmd": cmd, "timeout_seconds": timeout_seconds})
        if out["exit_code"] != 0:
            raise RuntimeError(f"{cmd!r} failed: {out}")
        return out


def first_select(url: str) -> float:
    started = time.monotonic()
    with psycopg.connect(url, connect_timeout=300, autocommit=True) as conn:
        conn.execute("SELECT 1").fetchone()
    return time.monotonic() - started


def create_to_select(api: Api) -> tuple[float, dict]:
    started = time.monotonic()
    created = api.call("POST", "/v1/databases", json={})
    info = api.ready(created["id"])
    first_select(info["connection_url"])
    return time.monotonic() - started, info


def median_ms(values) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms"


def pgbench(api: Api, sandbox: str, seconds: int, clients: int) -> float:
    # Initialised once per database; select-only, so that it measures the
    # server's reads (memory), not the guest's disk.
    api.exec(sandbox, "su postgres -c 'pgbench -q -i -s 2 clade' >/dev/null 2>&1 || su postgres -c 'pgbench -q -i -s 2 clade'")
    out = api.exec(sandbox, f"su postgres -c 'pgbench -S -n -c {clients} -j {clients} -T {seconds} clade'")
    match = re.search(r"tps = ([0-9.]+)", out["stdout"])
    if not match:
        raise RuntimeError(f"no tps in pgbench's output: {out['stdout']}")
    return float(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=10)
    parser.add_argument("--wakes", type=int, default=5)
    parser.add_argument("--clones", type=int, default=5)
    parser.add_argument("--recoveries", type=int, default=3, help="target_time clones and failovers, each")
    parser.add_argument("--pgbench-seconds", type=int, default=20)
    parser.add_argument("--pgbench-clients", type=int, default=2)
    args = parser.parse_args()

    server = CladeServer("db-bench", args=["--standby-horizon", "30"]).start()
    api = Api(server)
    figures: dict = {}
    try:
        first, db = create_to_select(api)
        figures["first create (bakes the template) → SELECT 1"] = f"{first:.1f} s"
        times = []
        for _ in range(args.creates):
            took, info = create_to_select(api)
            times.append(took)
            api.call("DELETE", f"/v1/databases/{info['id']}")
        figures[f"create → first SELECT 1 through the endpoint (median of {args.creates})"] = median_ms(times)
        figures["  p90 / max"] = f"{sorted(times)[int(len(times) * 0.9) - 1] * 1000:.0f} ms / {max(times) * 1000:.0f} ms"

        # A connection to a running database, then to a hibernated one.
        running = [first_select(db["connection_url"]) for _ in range(args.wakes)]
        wakes = []
        for _ in range(args.wakes):
            api.call("POST", f"/v1/sandboxes/{db['sandbox_id']}/hibernate")
            assert api.call("GET", f"/v1/databases/{db['id']}")["status"] == "hibernated"
            wakes.append(first_select(db["connection_url"]))
        figures["connect → first row, database running (median)"] = median_ms(running)
        figures["connect → first row, database hibernated: wake on connect (median)"] = median_ms(wakes)
        figures["  added by the wake"] = f"{(statistics.median(wakes) - statistics.median(running)) * 1000:.0f} ms"

        clones = []
        with psycopg.connect(db["connection_url"], autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS t AS SELECT g AS id FROM generate_series(1, 100000) g")
        for _ in range(args.clones):
            started = time.monotonic()
            clone = api.call("POST", f"/v1/databases/{db['id']}/clone", json={})
            clone = api.ready(clone["id"])
            with psycopg.connect(clone["connection_url"], connect_timeout=300, autocommit=True) as conn:
                assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 100000
            clones.append(time.monotonic() - started)
            api.call("DELETE", f"/v1/databases/{clone['id']}")
        figures[f"clone → first SELECT in the clone (median of {args.clones})"] = median_ms(clones)

        restored = pgbench(api, db["sandbox_id"], args.pgbench_seconds, args.pgbench_clients)
        # The same image booted cold: a sandbox of the template, hibernated
        # without its memory, woken (a boot of its disk, whose start hook
        # starts the server).
        cold = api.call("POST", "/v1/sandboxes", json={"template": "postgres", "persistent": True})["id"]
        api.call("POST", f"/v1/sandboxes/{cold}/hibernate", json={"memory": False})
        api.call("POST", f"/v1/sandboxes/{cold}/wake")
        booted = pgbench(api, cold, args.pgbench_seconds, args.pgbench_clients)
        api.call("DELETE", f"/v1/sandboxes/{cold}")
        figures[f"pgbench -S, {args.pgbench_clients} clients, {args.pgbench_seconds} s: database (snapshot-restored)"] = f"{restored:.0f} tps"
        figures["pgbench -S: the same image booted cold"] = f"{booted:.0f} tps"
        figures["  restored / cold"] = f"{restored / booted:.2f}×"

        # Its backups: the first base (taken in the background once it is
        # made), then clones as of an instant and failovers, both replays
        # of that base and the WAL after it in a new sandbox. Last: each
        # failover takes a new base in the background, which would share
        # the CPU with pgbench.
        started = time.monotonic()
        while not api.call("GET", f"/v1/databases/{db['id']}")["failover_available"]:
            if time.monotonic() - started > 600:
                raise RuntimeError("no base backup within 600 s")
            time.sleep(0.5)
        recovered, failovers = [], []
        for _ in range(args.recoveries):
            target = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            with psycopg.connect(db["connection_url"], autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (-1)")
            started = time.monotonic()
            clone = api.ready(api.call("POST", f"/v1/databases/{db['id']}/clone", json={"target_time": target})["id"])
            first_select(clone["connection_url"])
            recovered.append(time.monotonic() - started)
            api.call("DELETE", f"/v1/databases/{clone['id']}")
            started = time.monotonic()
            db = api.call("POST", f"/v1/databases/{db['id']}/failover")
            first_select(db["connection_url"])
            failovers.append(time.monotonic() - started)
        figures[f"target_time clone → first SELECT in the clone (median of {args.recoveries})"] = median_ms(recovered)
        figures[f"failover → first SELECT (median of {args.recoveries})"] = median_ms(failovers)
        api.call("DELETE", f"/v1/databases/{db['id']}")
    finally:
        server.teardown()
    width = max(len(k) for k in figures)
    for name, value in figures.items():
        print(f"{name:<{width}}  {value}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
