"""Many hosts, one API (issue 26's acceptance), through the unmodified SDK:
three `clade host run` agents (data directories and ports of their own) and
two `clade server --no-vms` replicas on one PostgreSQL this test starts.
Sandboxes spread over the hosts and are reached through either replica; a
drained host's forks land on other hosts and its hibernated sandboxes wake
on other hosts, files and processes intact; a host killed with SIGKILL has
its hibernated sandbox woken from the copy another host keeps; a host killed with SIGKILL loses what it ran (`lost`, within its lease) while
creates keep succeeding on the others; a replica killed mid-create leaves a
retry on the other replica with the same Idempotency-Key exactly one sandbox.

The hosts run without sandbox networking: on one machine, hosts would share
the nftables table and namespace names (each real host is a machine of its own).
"""

from __future__ import annotations

import datetime
import os
import pwd
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import List, Optional

import pandastack
import pytest
import requests
from pandastack import PandastackError

from conftest import BIN, REPO, TEMPLATE, free_port, kill_all, log_tail, processes_under, skip_or_fail, wait_for

SECRET = "sdk-cluster-secret-" + uuid.uuid4().hex
LEASE_SECONDS = 3


class Postgres:
    """A PostgreSQL of our own on a unix socket, as an unprivileged user."""

    def __init__(self):
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
        if not bins:
            skip_or_fail("PostgreSQL is not installed (scripts/install-host-deps)")
        self.bin = bins[0].parent
        self.user = pwd.getpwnam("postgres")
        self.dir = Path(tempfile.mkdtemp(prefix="clade-sdk-pg-"))
        os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        self.data = self.dir / "data"
        self.run("initdb", "-D", str(self.data), "-U", "clade", "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C")
        options = f"-k {self.dir} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-o", options, "-w", "-t", "60", "start")
        self.url = f"postgres://clade@localhost/postgres?host={self.dir}"

    def run(self, tool: str, *args: str) -> str:
        out = subprocess.run(
            [str(self.bin / tool), *args], user=self.user.pw_uid, group=self.user.pw_gid, cwd=self.dir,
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, f"{tool}: {out.stdout}{out.stderr}"
        return out.stdout

    def query(self, sql: str) -> List[List[str]]:
        out = self.run("psql", "-h", str(self.dir), "-U", "clade", "-d", "postgres", "-At", "-F", "\t", "-c", sql)
        return [line.split("\t") for line in out.splitlines() if line]

    def stop(self):
        subprocess.run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                       user=self.user.pw_uid, group=self.user.pw_gid, capture_output=True, timeout=60)


class Proc:
    """A `clade host run` or `clade server --no-vms` process."""

    def __init__(self, name: str, args: List[str], secret_file: Path):
        self.name = name
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"clade-sdk-{name}-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = self.data_dir / "process.log"
        self.env = {**os.environ, "NO_COLOR": "1", "CLADE_CLUSTER_SECRET_FILE": str(secret_file)}
        guestd = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "clade-guestd"
        if "CLADE_GUESTD" not in self.env and guestd.is_file():
            self.env["CLADE_GUESTD"] = str(guestd)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Proc":
        cmd = [str(BIN), *[a.replace("{port}", str(self.port)).replace("{dir}", str(self.data_dir)) for a in self.args]]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        headers = {"x-clade-cluster-secret": SECRET}

        def healthy():
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log_tail()}"
            try:
                return requests.get(f"{self.url}/healthz", headers=headers, timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(healthy, timeout=120, what=f"{self.name} to answer")
        return self

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def vm_pids(self) -> List[int]:
        return processes_under(self.data_dir, self.proc.pid if self.proc else None)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


class Cluster:
    """A PostgreSQL and the hosts and replicas started on it; stopped together."""

    def __init__(self):
        self.pg = Postgres()
        self.secret_file = Path(tempfile.mkdtemp(prefix="clade-sdk-secret-")) / "cluster.secret"
        self.secret_file.write_text(SECRET + "\n")
        self.procs: List[Proc] = []

    def host(self, name: str) -> Proc:
        proc = Proc(name, ["host", "--data-dir", "{dir}", "--database-url", self.pg.url, "run", "--listen", "127.0.0.1:{port}",
                           "--no-network", "--standby", "0", "--lease-seconds", str(LEASE_SECONDS),
                           "--replicate-hibernated"], self.secret_file)
        self.procs.append(proc)
        return proc.start()

    def replica(self, name: str, *args: str) -> Proc:
        proc = Proc(name, ["server", "--no-vms", "--data-dir", "{dir}", "--database-url", self.pg.url, "--listen",
                           "127.0.0.1:{port}", *args], self.secret_file)
        self.procs.append(proc)
        return proc.start()

    def stop(self, failed: bool):
        for proc in self.procs:
            proc.kill()
            kill_all(proc.vm_pids())
        self.pg.stop()
        if failed:
            for proc in self.procs:
                print(f"--- {proc.name} ---\n{proc.log_tail()}")


@pytest.fixture
def new_cluster(requirements):
    """Starts a Cluster for one test; stops it after, with its logs when the test failed."""
    made: List[Cluster] = []

    def start() -> Cluster:
        made.append(Cluster())
        return made[-1]

    failed = False
    try:
        yield start
    except BaseException:
        failed = True
        raise
    finally:
        for cluster in made:
            cluster.stop(failed)


@pytest.fixture
def cluster(new_cluster):
    c = new_cluster()
    hosts = [c.host(f"host-{i}") for i in range(3)]
    # The default databases' endpoint address is one per machine: the replicas run none here.
    replicas = [c.replica(f"replica-{i}", "--db-listen", "off") for i in range(2)]
    admin_key = (replicas[0].data_dir / "admin.key").read_text().strip()
    yield c.pg, hosts, replicas, admin_key


def hosts_of(pg: Postgres, ids: List[str]) -> dict:
    listed = ",".join(f"'{i}'" for i in ids)
    return dict(pg.query(f"SELECT id, host_id FROM sandboxes WHERE id IN ({listed})"))


def test_many_hosts_serve_one_api_and_survive_a_dead_host_and_a_dead_replica(cluster):
    pg, hosts, replicas, admin_key = cluster
    clients = [pandastack.Client(api_key=admin_key, api_url=r.url) for r in replicas]
    host_ids = {h.name: (h.data_dir / "host.id").read_text().strip() for h in hosts}

    # Twelve creates, alternating replicas, spread over the three hosts.
    made = [clients[i % 2].sandboxes.create(template=TEMPLATE, metadata={"n": str(i)}) for i in range(12)]
    placed = hosts_of(pg, [s.id for s in made])
    per_host = {h: sum(1 for v in placed.values() if v == h) for h in host_ids.values()}
    print(f"placement: {per_host}")
    assert all(n >= 2 for n in per_host.values()), per_host

    # Exec and files on each, through both replicas.
    for sb in made:
        via_a = clients[0].sandboxes.get(sb.id)
        via_b = clients[1].sandboxes.get(sb.id)
        assert via_a.exec(f"echo {sb.id} > /tmp/me && cat /tmp/me").stdout.strip() == sb.id
        assert via_b.filesystem.read("/tmp/me").decode().strip() == sb.id
        via_b.filesystem.write("/tmp/from-b", "b")
        assert via_a.exec("cat /tmp/from-b").stdout == "b"

    # A fork lands on its parent's host and sees its files.
    child = clients[1].sandboxes.get(made[0].id).fork()
    assert hosts_of(pg, [child.id])[child.id] == placed[made[0].id]
    assert child.exec("cat /tmp/me").stdout.strip() == made[0].id

    # A volume's sandboxes run on the host that has its files, whichever
    # replica is asked; its data outlives them.
    clients[0].volumes.create("shared-data", 32)
    volume_host = pg.query("SELECT host_id FROM volumes WHERE name = 'shared-data'")[0][0]
    for i, via in enumerate(clients):
        with_volume = via.sandboxes.create(template=TEMPLATE, volumes=[{"name": "shared-data"}])
        assert hosts_of(pg, [with_volume.id])[with_volume.id] == volume_host
        out = with_volume.exec(f"mkdir -p /v && mount /dev/vdb /v && echo {i} >> /v/log && sync && cat /v/log")
        assert out.stdout.split() == [str(n) for n in range(i + 1)], out.stderr
        with_volume.kill()
    clients[1].volumes.delete("shared-data")

    # `clade host drain`: a fork of a sandbox there lands on another host, with
    # the parent's files and processes; a sandbox hibernated there wakes on another.
    parent = clients[0].sandboxes.get(made[0].id)
    parent_host = placed[parent.id]
    parent.exec("nohup sleep 4242 >/dev/null 2>&1 &")
    sleeper = clients[0].sandboxes.get(next(s.id for s in made[1:] if placed[s.id] == parent_host))
    sleeper.exec("nohup sleep 4343 >/dev/null 2>&1 &")
    host_cli = [str(BIN), "host", "--database-url", pg.url]
    drained = subprocess.run([*host_cli, "drain", parent_host], capture_output=True, text=True, timeout=60)
    assert drained.returncode == 0, drained.stderr
    started = time.monotonic()
    far = parent.fork()
    print(f"cross-host fork answered in {time.monotonic() - started:.2f} s")
    assert hosts_of(pg, [far.id])[far.id] not in (parent_host, None)
    assert far.exec("cat /tmp/me").stdout.strip() == parent.id
    assert far.exec("pgrep -f 'sleep 4242' >/dev/null && echo running").stdout == "running\n"
    clients[1].sandboxes.get(sleeper.id).hibernate()
    started = time.monotonic()
    woken = clients[1].sandboxes.get(sleeper.id).exec("cat /tmp/me; pgrep -f 'sleep 4343' >/dev/null && echo running")
    print(f"wake on another host answered in {time.monotonic() - started:.2f} s")
    assert woken.stdout.split() == [sleeper.id, "running"]
    assert hosts_of(pg, [sleeper.id])[sleeper.id] not in (parent_host, None)
    undrained = subprocess.run([*host_cli, "undrain", parent_host], capture_output=True, text=True, timeout=60)
    assert undrained.returncode == 0, undrained.stderr
    placed = hosts_of(pg, [s.id for s in made])

    # SIGKILL one host: within its lease, what it ran is lost; creates keep succeeding.
    victim = hosts[1]
    victim_id = host_ids[victim.name]
    on_victim = [sb.id for sb in made if placed[sb.id] == victim_id]
    # One of them hibernated first: a copy is kept on another host (--replicate-hibernated).
    keeper = clients[0].sandboxes.get(on_victim.pop())
    keeper.exec("nohup sleep 4444 >/dev/null 2>&1 &")
    keeper.hibernate()

    def copy_holder():
        rows = pg.query(f"SELECT replica_host_id FROM sandboxes WHERE id = '{keeper.id}'")
        return rows and rows[0] and rows[0][0] not in ("", victim_id) and rows[0][0]

    wait_for(copy_holder, timeout=60, interval=0.2, what="a copy of the hibernated sandbox on another host")
    holder = copy_holder()
    victim.kill()
    killed_at = time.monotonic()
    wait_for(lambda: all(clients[0].sandboxes.get(i).status == "lost" for i in on_victim),
             timeout=LEASE_SECONDS * 4, interval=0.2, what="the dead host's sandboxes to be lost")
    print(f"lost after {time.monotonic() - killed_at:.1f} s (lease {LEASE_SECONDS} s)")
    with pytest.raises(PandastackError):
        clients[1].sandboxes.get(on_victim[0]).exec("true")
    # The hibernated one wakes from its copy on the other host: files and processes.
    started = time.monotonic()
    woken = clients[1].sandboxes.get(keeper.id).exec("cat /tmp/me; pgrep -f 'sleep 4444' >/dev/null && echo running")
    print(f"woken from its copy after its host died in {time.monotonic() - started:.2f} s")
    assert woken.stdout.split() == [keeper.id, "running"]
    assert hosts_of(pg, [keeper.id])[keeper.id] == holder
    after = [clients[i % 2].sandboxes.create(template=TEMPLATE) for i in range(3)]
    assert all(h != victim_id for h in hosts_of(pg, [s.id for s in after]).values())
    clients[0].sandboxes.get(on_victim[0]).kill()

    # SIGKILL a replica mid-create: the retry on the other, same key, ends with one sandbox.
    key = str(uuid.uuid4())
    tag = f"cluster-{key[:8]}"
    outcome = {}

    def keyed(client):
        client.session.headers["Idempotency-Key"] = key
        return client

    def first_attempt():
        try:
            outcome["sandbox"] = keyed(pandastack.Client(api_key=admin_key, api_url=replicas[1].url)).sandboxes.create(
                template=TEMPLATE, metadata={"tag": tag})
        except PandastackError as e:
            outcome["error"] = e

    attempt = threading.Thread(target=first_attempt)
    attempt.start()
    wait_for(lambda: pg.query(f"SELECT state FROM idempotency_keys WHERE idem_key = '{key}'") == [["pending"]],
             timeout=60, interval=0.005, what="the create to hold its key")
    replicas[1].kill()
    attempt.join(60)
    started = time.monotonic()
    retried = keyed(pandastack.Client(api_key=admin_key, api_url=replicas[0].url)).sandboxes.create(
        template=TEMPLATE, metadata={"tag": tag})
    print(f"retry answered after {time.monotonic() - started:.1f} s; first attempt: {sorted(outcome)}")
    tagged = [s.id for s in clients[0].sandboxes.list() if (s.metadata or {}).get("tag") == tag]
    assert tagged == [retried.id]
    assert retried.exec("echo once").stdout == "once\n"

    for sb in [*made, *after, child, far, retried]:
        if sb.id not in on_victim:
            clients[0].sandboxes.get(sb.id).kill()


@pytest.mark.timeout(900)
def test_a_database_is_reached_through_the_replicas_endpoint_on_whichever_host_runs_it(new_cluster):
    """Issue 33 in a cluster: the replica places a database on a host, runs the
    PostgreSQL endpoint its connection_url names and relays each connection
    to the host of its sandbox (which wakes it); every route about it, the
    broker's included, goes to that host; when that host dies, connections
    and uses are refused with the reason while the row can still be read
    and deleted."""
    import psycopg

    c = new_cluster()
    hosts = [c.host(f"host-{i}") for i in range(2)]
    db_port = free_port()
    replica = c.replica("replica-0", "--db-listen", f"127.0.0.1:{db_port}")
    admin_key = (replica.data_dir / "admin.key").read_text().strip()
    client = pandastack.Client(api_key=admin_key, api_url=replica.url)
    host_ids = {(h.data_dir / "host.id").read_text().strip(): h for h in hosts}

    started = time.monotonic()
    db = client.databases.create(label="clustered")
    print(f"create -> running on a fresh host (its first postgres bake): {time.monotonic() - started:.1f} s")
    assert db["status"] == "running", db
    assert f"@{db['id']}.db.localhost:{db_port}/" in db["connection_url"], "the replica's endpoint, not a host's"
    assert db["broker_url"] == f"{replica.url}/v1/databases/{db['id']}/proxy"
    runs_on = hosts_of(c.pg, [db["sandbox_id"]])[db["sandbox_id"]]
    assert runs_on in host_ids

    def connect(url: str):
        return psycopg.connect(url, connect_timeout=120, autocommit=True)

    with connect(db["connection_url"]) as conn:
        conn.execute("CREATE TABLE t (n int)")
        conn.execute("INSERT INTO t VALUES (1), (2)")
    broker = requests.post(db["broker_url"], headers={"Authorization": f"Bearer {db['broker_token']}"},
                           json={"sql": "SELECT n FROM t ORDER BY n"}, timeout=120)
    assert broker.status_code == 200, broker.text
    assert broker.json()["rows"] == [[1], [2]]
    assert requests.post(db["broker_url"], headers={"Authorization": "Bearer pds_pg_wrong"},
                         json={"sql": "SELECT 1"}, timeout=60).status_code == 401
    auth = {"Authorization": f"Bearer {admin_key}"}
    stats = requests.get(f"{replica.url}/v1/databases/{db['id']}/stats", headers=auth, timeout=120)
    assert stats.status_code == 200 and stats.json()["postgres_version"].startswith("15."), stats.text

    # Asleep, it is woken by the next connection through the replica.
    client.sandboxes.get(db["sandbox_id"]).hibernate()
    assert client.databases.get(db["id"])["status"] == "hibernated"
    started = time.monotonic()
    with connect(db["connection_url"]) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 2
    print(f"wake on connect through the replica: {time.monotonic() - started:.2f} s")

    # A clone is a fork on the same host, reached the same way; its writes stay its own.
    clone = client.databases.clone(db["id"], label="copy")
    assert clone["status"] == "running", clone
    assert hosts_of(c.pg, [clone["sandbox_id"]])[clone["sandbox_id"]] == runs_on
    with connect(clone["connection_url"]) as conn:
        conn.execute("INSERT INTO t VALUES (100)")
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 3
    with connect(db["connection_url"]) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 2

    # Any host tells whether a failover can run (the row names where the backups are).
    wait_for(lambda: all(d["failover_available"] for d in client.databases.list() if d["id"] == db["id"]),
             timeout=300, interval=1, what="a base backup, seen in the list")
    backups_on = c.pg.query(f"SELECT backup_host_id FROM databases WHERE id = '{db['id']}'")[0][0]
    assert backups_on == runs_on

    # The other host keeps a copy of its backups, WAL shipped later included
    # (a target_time clone ships what its source wrote first).
    other = next(h for h in host_ids if h != runs_on)
    wait_for(lambda: c.pg.query(f"SELECT backup_copy_host_id FROM databases WHERE id = '{db['id']}'") == [[other]],
             timeout=120, interval=0.5, what="a copy of its backups on the other host")
    with connect(db["connection_url"]) as conn:
        conn.execute("INSERT INTO t VALUES (3)")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    as_of = client.databases.clone(db["id"], target_time=now, label="as of now")
    assert as_of["status"] == "running", as_of
    client.databases.delete(as_of["id"])

    # Its host dies: uses are refused with the reason, the row is readable,
    # and a failover rebuilds it on the host with the copy, same URL, every commit shipped.
    host_ids[runs_on].kill()
    wait_for(lambda: c.pg.query(f"SELECT state FROM hosts WHERE id = '{runs_on}'") == [["down"]],
             timeout=LEASE_SECONDS * 4, interval=0.2, what="the dead host to be marked down")
    with pytest.raises(psycopg.OperationalError, match="which is down"):
        connect(db["connection_url"]).close()
    stats = requests.get(f"{replica.url}/v1/databases/{db['id']}/stats", headers=auth, timeout=120)
    assert stats.status_code == 503 and "which is down" in stats.text and "failover" in stats.text, stats.text
    assert client.databases.get(db["id"])["id"] == db["id"]
    started = time.monotonic()
    after = client.databases.failover(db["id"])
    print(f"failover onto the copy's host after its own died: {time.monotonic() - started:.1f} s")
    assert after["status"] == "running" and after["connection_url"] == db["connection_url"], after
    assert hosts_of(c.pg, [after["sandbox_id"]])[after["sandbox_id"]] == other
    with connect(db["connection_url"]) as conn:
        assert conn.execute("SELECT string_agg(n::text, ',' ORDER BY n) FROM t").fetchone()[0] == "1,2,3"
        conn.execute("INSERT INTO t VALUES (4)")
    assert c.pg.query(f"SELECT state FROM sandboxes WHERE id = '{db['sandbox_id']}'") == [["deleted"]]

    # The clone's host is still down: it is deleted all the same; the rebuilt one normally.
    client.databases.delete(clone["id"])
    assert c.pg.query(f"SELECT state FROM sandboxes WHERE id = '{clone['sandbox_id']}'") == [["deleted"]]
    client.databases.delete(db["id"])
    assert [d["id"] for d in client.databases.list()] == []
    assert not (host_ids[other].data_dir / "db-backups" / db["id"]).exists()


def test_a_function_runs_on_the_host_that_keeps_its_snapshot_and_on_another_when_that_one_dies(new_cluster):
    """Issue 34 in a cluster: a function deployed through a replica is
    snapshotted on one host; its invokes and its public host go there; when
    that host dies, the next invoke deploys the kept code on the other host
    and runs there, and so do its schedules' triggers."""
    c = new_cluster()
    hosts = [c.host(f"host-{i}") for i in range(2)]
    replica = c.replica("replica-0", "--db-listen", "off")
    admin_key = (replica.data_dir / "admin.key").read_text().strip()
    client = pandastack.Client(api_key=admin_key, api_url=replica.url, timeout=600)
    host_ids = {(h.data_dir / "host.id").read_text().strip(): h for h in hosts}

    source = Path(tempfile.mkdtemp(prefix="clade-sdk-fn-")) / "handler.py"
    # Over HTTP the event is the request: its number is in the body.
    source.write_text("import json\ndef handler(event):\n    n = event['n'] if 'n' in event else json.loads(event['body'])['n']\n    return {'n': n * 2}\n")
    fn = client.functions.create("doubler", "python", str(source), template=TEMPLATE, public=True)
    wait_for(lambda: client.functions.get(fn["id"])["status"] == "ready", timeout=600, interval=0.5, what="the deploy")
    kept_on = c.pg.query(f"SELECT host_id FROM functions WHERE id = '{fn['id']}'")[0][0]
    assert kept_on in host_ids
    run = client.functions.invoke(fn["id"], input={"n": 21})
    assert run["status"] == "success" and run["output"] == {"n": 42}, run
    assert hosts_of(c.pg, [run["sandbox_id"]])[run["sandbox_id"]] == kept_on
    port = replica.url.rsplit(":", 1)[1]
    answer = requests.post(f"{replica.url}/", json={"n": 5}, headers={"Host": f"{fn['id']}.localhost:{port}"}, timeout=600)
    assert answer.status_code == 200 and answer.json() == {"n": 10}, answer.text
    schedule = client._request("POST", "/schedules", json={"name": "nightly", "function_id": fn["id"], "cron": "0 3 * * *", "input": {"n": 1}})

    host_ids[kept_on].kill()
    wait_for(lambda: c.pg.query(f"SELECT state FROM hosts WHERE id = '{kept_on}'") == [["down"]],
             timeout=LEASE_SECONDS * 4, interval=0.2, what="the dead host to be marked down")
    started = time.monotonic()
    moved = client.functions.invoke(fn["id"], input={"n": 4})
    print(f"invoke after the function's host died (a deploy on the other host, then the run): {time.monotonic() - started:.1f} s")
    other = next(h for h in host_ids if h != kept_on)
    assert moved["status"] == "success" and moved["output"] == {"n": 8}, (moved.get("stderr"), moved)
    assert hosts_of(c.pg, [moved["sandbox_id"]])[moved["sandbox_id"]] == other
    assert c.pg.query(f"SELECT host_id FROM functions WHERE id = '{fn['id']}'") == [[other]]
    triggered = client.schedules.trigger(schedule["id"])
    assert triggered["status"] == "success" and triggered["output"] == {"n": 2}, triggered
    assert hosts_of(c.pg, [triggered["sandbox_id"]])[triggered["sandbox_id"]] == other
    assert len(client.functions.runs(fn["id"])) == 4
    client.functions.delete(fn["id"])
    assert client.functions.list() == [] and client.schedules.list() == []
