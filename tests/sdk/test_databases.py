"""Managed PostgreSQL (issue 33) through the unmodified SDK's
`client.databases`, with a real driver (psycopg) on the `connection_url` the
API returns: TLS through the server's endpoint, routed by server name to a
PostgreSQL 15 inside the database's VM.

One database is made for the module and taken through its life in order
(data, broker, idle hibernation and wake on connect, clone, credentials
reset): each step builds on the last, as a user's would.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from typing import Iterator

import pandastack
import psycopg
import pytest
import requests

from conftest import BIN

pytestmark = pytest.mark.timeout(900)


def connect(url: str, timeout: int = 120) -> psycopg.Connection:
    return psycopg.connect(url, connect_timeout=timeout, autocommit=True)


def scalar(url: str, sql: str, params=None):
    with connect(url) as conn:
        return conn.execute(sql, params).fetchone()[0]


def raw(server, method: str, path: str, key=None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key or server.admin_key}"}
    return requests.request(method, f"{server.url}{path}", headers=headers, timeout=120, **kwargs)


def wait_for_status(client: pandastack.Client, db_id: str, status: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = client.databases.get(db_id)
        if info["status"] == status:
            return info
        assert time.monotonic() < deadline, f"database {db_id} never became {status}: {info}"
        time.sleep(0.5)


def wait_for(check, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def database(client) -> Iterator[dict]:
    started = time.monotonic()
    db = client.databases.create(label="orders")
    print(f"create -> running: {time.monotonic() - started:.1f} s")
    yield db
    try:
        client.databases.delete(db["id"])
    except pandastack.PandastackError:
        pass


def test_a_created_database_takes_a_driver_over_tls_with_its_url_as_returned(client, database):
    assert database["status"] == "running"
    assert database["label"] == "orders"
    assert database["connection_url"].startswith("postgresql://clade:")
    assert f"@{database['id']}.db.localhost:" in database["connection_url"]
    assert database["password"] in database["connection_url"]
    assert database["broker_token"].startswith("pds_pg_")
    with connect(database["connection_url"]) as conn:
        assert conn.info.parameter_status("server_version").startswith("15.")
        # The endpoint is TLS end to end from the client's side.
        assert conn.pgconn.ssl_in_use
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, item text, qty int)")
        conn.execute("INSERT INTO orders VALUES (1, 'apple', 3), (2, 'pear', 5)")
    assert scalar(database["connection_url"], "SELECT sum(qty) FROM orders") == 8
    # GET answers the same credentials; the list shows it without them.
    again = client.databases.get(database["id"])
    assert again["connection_url"] == database["connection_url"]
    listed = client.databases.list()
    mine = [d for d in listed if d["id"] == database["id"]]
    assert len(mine) == 1 and "password" not in mine[0]
    connection = client.databases.connection(database["id"])
    assert connection["connection_url"] == database["connection_url"]
    assert connection["broker_token"] == database["broker_token"]


def test_the_broker_runs_a_statement_with_parameters_by_the_databases_own_token(server, database):
    answer = requests.post(
        database["broker_url"],
        headers={"Authorization": f"Bearer {database['broker_token']}"},
        json={"sql": "SELECT id, item, qty FROM orders WHERE qty > $1 ORDER BY id", "params": [4]},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [c["name"] for c in body["columns"]] == ["id", "item", "qty"]
    assert body["rows"] == [[2, "pear", 5]]
    inserted = requests.post(
        database["broker_url"],
        headers={"Authorization": f"Bearer {database['broker_token']}"},
        json={"sql": "INSERT INTO orders VALUES ($1, $2, $3)", "params": [3, "plum", 1]},
        timeout=60,
    )
    assert inserted.status_code == 200, inserted.text
    assert inserted.json()["row_count"] == 1
    # SQL errors come back with their SQLSTATE; an API key is not a broker token.
    bad = requests.post(
        database["broker_url"], headers={"Authorization": f"Bearer {database['broker_token']}"},
        json={"sql": "SELECT * FROM no_such_table"}, timeout=60,
    )
    assert bad.status_code == 400 and "42P01" in bad.text
    assert raw(server, "POST", f"/v1/databases/{database['id']}/proxy", json={"sql": "SELECT 1"}).status_code == 401
    assert requests.post(database["broker_url"], json={"sql": "SELECT 1"}, timeout=60).status_code == 401


def test_stats_and_logs(server, database):
    stats = raw(server, "GET", f"/v1/databases/{database['id']}/stats")
    assert stats.status_code == 200, stats.text
    assert stats.json()["postgres_version"].startswith("15.")
    assert stats.json()["db_size_bytes"] > 0
    logs = raw(server, "GET", f"/v1/databases/{database['id']}/logs")
    assert logs.status_code == 200 and "database system is ready to accept connections" in logs.json()["logs"]


def test_another_workspace_never_sees_nor_reaches_it(server, other_client, database):
    with pytest.raises(pandastack.NotFoundError):
        other_client.databases.get(database["id"])
    assert database["id"] not in [d["id"] for d in other_client.databases.list()]
    for method, path in [("DELETE", ""), ("POST", "/reset-credentials"), ("GET", "/connection"), ("POST", "/clone")]:
        answer = raw(server, method, f"/v1/databases/{database['id']}{path}", key=other_client.api_key)
        assert answer.status_code == 404, (method, path, answer.text)
    # An unknown id reaches no server: the endpoint refuses it by name.
    unknown = database["connection_url"].replace(database["id"], "db-0000000000000000")
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        connect(unknown, timeout=30)
    # A client that does not speak TLS is told to.
    with pytest.raises(psycopg.OperationalError, match="requires TLS"):
        connect(database["connection_url"].replace("sslmode=require", "sslmode=disable"), timeout=30)


def test_an_idle_database_hibernates_and_a_connection_wakes_it(client, server, database):
    sandbox = database["sandbox_id"]
    answer = raw(server, "PATCH", f"/v1/sandboxes/{sandbox}/lifecycle", json={"hibernate_after_seconds": 2})
    assert answer.status_code == 200, answer.text
    wait_for_status(client, database["id"], "hibernated", timeout=120)
    # Back to the server's default before the wake, so it stays up for the next steps.
    raw(server, "PATCH", f"/v1/sandboxes/{sandbox}/lifecycle", json={"hibernate_after_seconds": 3600})
    started = time.monotonic()
    assert scalar(database["connection_url"], "SELECT count(*) FROM orders") == 3
    print(f"wake on connect -> first row: {time.monotonic() - started:.2f} s")
    assert client.databases.get(database["id"])["status"] == "running"
    # always_on is kept and shown.
    assert client.databases.update(database["id"], always_on=True)["always_on"] is True
    assert client.databases.wake(database["id"])["status"] == "running"


def test_a_clone_sees_the_data_at_its_instant_and_keeps_its_writes(client, server, database):
    clone = client.databases.clone(database["id"])
    try:
        assert clone["cloned_from"] == database["id"]
        assert clone["label"] == "orders (clone)"
        assert clone["password"] != database["password"]
        assert scalar(clone["connection_url"], "SELECT count(*) FROM orders") == 3
        with connect(clone["connection_url"]) as conn:
            conn.execute("INSERT INTO orders VALUES (10, 'clone-only', 1)")
        with connect(database["connection_url"]) as conn:
            conn.execute("INSERT INTO orders VALUES (20, 'parent-only', 1)")
        assert scalar(clone["connection_url"], "SELECT string_agg(item, ',' ORDER BY id) FROM orders WHERE id >= 10") == "clone-only"
        assert scalar(database["connection_url"], "SELECT string_agg(item, ',' ORDER BY id) FROM orders WHERE id >= 10") == "parent-only"
        # The parent's password does not open the clone.
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            connect(database["connection_url"].replace(database["id"], clone["id"]), timeout=60)
    finally:
        client.databases.delete(clone["id"])
    with pytest.raises(pandastack.NotFoundError):
        client.databases.get(clone["id"])


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_a_target_time_clone_is_the_database_as_it_was_at_that_instant(client, server, database):
    # The first base backup is taken in the background once a database is made.
    wait_for(lambda: client.databases.get(database["id"])["failover_available"], "a base backup", timeout=300)
    with connect(database["connection_url"]) as conn:
        conn.execute("CREATE TABLE ledger (n int)")
        conn.execute("INSERT INTO ledger VALUES (1)")
    time.sleep(1.5)
    target = utc_now()
    time.sleep(1.5)
    with connect(database["connection_url"]) as conn:
        conn.execute("INSERT INTO ledger VALUES (2)")
        conn.execute("UPDATE orders SET qty = qty + 100")
    started = time.monotonic()
    clone = client.databases.clone(database["id"], target_time=target, label="as of then")
    print(f"target_time clone -> running: {time.monotonic() - started:.1f} s")
    try:
        assert clone["status"] == "running" and clone["cloned_from"] == database["id"], clone
        assert scalar(clone["connection_url"], "SELECT string_agg(n::text, ',' ORDER BY n) FROM ledger") == "1"
        assert scalar(clone["connection_url"], "SELECT max(qty) FROM orders") < 100
        # It is promoted: a database of its own, which takes writes; the source kept everything.
        with connect(clone["connection_url"]) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False
            conn.execute("INSERT INTO ledger VALUES (99)")
        assert scalar(database["connection_url"], "SELECT string_agg(n::text, ',' ORDER BY n) FROM ledger") == "1,2"
    finally:
        client.databases.delete(clone["id"])
    # Instants it cannot be as of are refused with the rule, and nothing is made.
    before = len(client.databases.list())
    for when, says in [("2020-01-01T00:00:00Z", "or later"), ("2999-01-01T00:00:00Z", "has not come yet"), ("yesterday", "RFC 3339")]:
        answer = raw(server, "POST", f"/v1/databases/{database['id']}/clone", json={"target_time": when})
        assert answer.status_code == 400 and says in answer.text, (when, answer.text)
    assert len(client.databases.list()) == before


def test_reset_credentials_refuses_the_old_password(client, database):
    old_url = database["connection_url"]
    with connect(old_url) as held:
        reset = client.databases.reset_credentials(database["id"])
        assert reset["password"] != database["password"]
        assert reset["broker_token"] != database["broker_token"]
        # Sessions of the old password are ended too.
        with pytest.raises(psycopg.OperationalError):
            held.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        connect(old_url, timeout=60)
    assert scalar(reset["connection_url"], "SELECT count(*) FROM orders") == 4
    old_broker = requests.post(
        reset["broker_url"], headers={"Authorization": f"Bearer {database['broker_token']}"}, json={"sql": "SELECT 1"}, timeout=60
    )
    assert old_broker.status_code == 401


def test_failover_rebuilds_it_from_its_backups_under_the_same_address(client, server, database):
    before = client.databases.get(database["id"])
    with connect(before["connection_url"]) as conn:
        conn.execute("INSERT INTO ledger VALUES (3)")
    started = time.monotonic()
    after = client.databases.failover(database["id"])
    print(f"failover: {time.monotonic() - started:.1f} s")
    assert after["id"] == before["id"] and after["status"] == "running"
    assert after["sandbox_id"] != before["sandbox_id"]
    assert after["connection_url"] == before["connection_url"]
    # Everything committed is there, through the same URL and password.
    assert scalar(before["connection_url"], "SELECT string_agg(n::text, ',' ORDER BY n) FROM ledger") == "1,2,3"
    assert raw(server, "GET", f"/v1/sandboxes/{before['sandbox_id']}").status_code == 404
    with connect(before["connection_url"]) as conn:
        conn.execute("INSERT INTO ledger VALUES (4)")
    # An unknown database has nothing to fail over.
    assert raw(server, "POST", "/v1/databases/db-0000000000000000/failover").status_code == 404


def test_a_database_woken_from_its_disk_alone_starts_its_server(client, server, database):
    current = client.databases.get(database["id"])
    answer = raw(server, "POST", f"/v1/sandboxes/{current['sandbox_id']}/hibernate", json={"memory": False})
    assert answer.status_code == 200, answer.text
    assert client.databases.get(database["id"])["status"] == "hibernated"
    # The connection wakes it: a boot of its disk, whose start hook starts
    # PostgreSQL, which recovers from its WAL what it had committed.
    assert scalar(current["connection_url"], "SELECT string_agg(n::text, ',' ORDER BY n) FROM ledger") == "1,2,3,4"


def test_a_size_is_its_disk_and_memory_asleep_and_in_its_clones_too(client):
    def disk_bytes(sandbox_id: str) -> int:
        out = client.sandboxes.get(sandbox_id).exec("df -B1 --output=size / | tail -n 1")
        return int(out.stdout)

    db = client.databases.create(size="4g", label="sized")
    try:
        assert db["size"] == "4g" and db["memory_mb"] == 1024, db
        # 4 GiB of data, the system and the WAL: a 6 GiB disk (the template's is 4).
        assert disk_bytes(db["sandbox_id"]) > 5.5 * 2**30
        with connect(db["connection_url"]) as conn:
            conn.execute("CREATE TABLE big AS SELECT g AS n, repeat('x', 500) AS pad FROM generate_series(1, 20000) g")
        client.sandboxes.get(db["sandbox_id"]).hibernate()
        assert scalar(db["connection_url"], "SELECT count(*) FROM big") == 20000
        assert disk_bytes(db["sandbox_id"]) > 5.5 * 2**30
        clone = client.databases.clone(db["id"])
        try:
            assert disk_bytes(clone["sandbox_id"]) > 5.5 * 2**30
            assert scalar(clone["connection_url"], "SELECT count(*) FROM big") == 20000
        finally:
            client.databases.delete(clone["id"])
    finally:
        client.databases.delete(db["id"])


def test_bad_requests_are_refused_with_the_rule(client, server):
    answer = raw(server, "POST", "/v1/databases", json={"size": "3g"})
    assert answer.status_code == 400 and "1g, 4g, 16g" in answer.text
    assert raw(server, "POST", "/v1/databases", json={"cpu": 0}).status_code == 400
    assert raw(server, "POST", "/v1/databases", data="{not json").status_code == 400
    with pytest.raises(pandastack.NotFoundError):
        client.databases.get("db-0000000000000000")
    assert raw(server, "DELETE", "/v1/databases/db-0000000000000000").status_code == 404


def test_the_cli_makes_connects_to_clones_and_removes_a_database(server):
    def clade(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "CLADE_API_URL": server.url, "CLADE_API_KEY": server.admin_key, "CLADE_CONFIG": "/nonexistent"}
        done = subprocess.run([str(BIN), *args], env=env, capture_output=True, text=True, timeout=600)
        if check:
            assert done.returncode == 0, f"clade {args}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    made = json.loads(clade("db", "create", "--json", "--label", "cli").stdout)
    assert made["status"] == "running" and made["connection_url"], made
    table = clade("db", "ls").stdout
    assert table.startswith("ID") and any(line.startswith(made["id"]) and "running" in line for line in table.splitlines()), table
    # `connect` runs the host's psql with the URL; psql's own arguments follow `--`.
    assert clade("db", "connect", made["id"], "--", "-Atc", "select 41 + 1").stdout.strip() == "42"
    clone = json.loads(clade("db", "clone", "--json", made["id"]).stdout)
    assert clone["cloned_from"] == made["id"] and clone["label"] == "cli (clone)"
    # Failover once its first base backup is there; a clone as of before it is refused with the rule.
    wait_for(lambda: json.loads(clade("db", "get", "--json", made["id"]).stdout)["failover_available"], "a base backup", timeout=300)
    rebuilt = json.loads(clade("db", "failover", "--json", made["id"]).stdout)
    assert rebuilt["id"] == made["id"] and rebuilt["sandbox_id"] != made["sandbox_id"], rebuilt
    assert clade("db", "connect", made["id"], "--", "-Atc", "select 6 * 7").stdout.strip() == "42"
    too_early = clade("db", "clone", made["id"], "--at", "2020-01-01T00:00:00Z", check=False)
    assert too_early.returncode == 125 and "or later" in too_early.stderr, too_early.stderr
    reset = json.loads(clade("db", "reset-credentials", "--json", made["id"]).stdout)
    assert reset["password"] != made["password"]
    assert clade("db", "rm", made["id"], clone["id"]).stdout.splitlines() == [f"deleted {made['id']}", f"deleted {clone['id']}"]
    gone = clade("db", "get", made["id"], check=False)
    assert gone.returncode == 125 and "(HTTP 404)" in gone.stderr
