"""Managed PostgreSQL through `client.databases`: a database made and
waited for, statements through the HTTP broker, stats and logs, a clone
that has the data, a credentials reset that shuts out the old broker
token, and deletes; and a create cancelled while it waits, which deletes
the database it was making. The first database of the server bakes the
`postgres` template (tens of seconds); later ones are restores (about a
second)."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import httpx
import pytest

import clade
from conftest import Server


def test_a_database_is_made_queried_cloned_reset_and_deleted(client: clade.Clade, postgres_ready: None) -> None:
    db = client.databases.create(label="orders")
    clone_id: Optional[str] = None
    try:
        assert db.status == "running" and db.label == "orders" and db.postgres_version == "15"
        assert db.connection_url and db.connection_url.startswith("postgresql://clade:")
        assert db.broker_token and db.broker_token.startswith("pds_pg_")
        assert [d.id for d in client.databases.list()].count(db.id) == 1
        assert client.databases.connection(db.id).broker_token == db.broker_token

        # Statements through the broker, its token fetched by the SDK.
        created = client.databases.query(db.id, "CREATE TABLE orders (id int PRIMARY KEY, item text, qty int)")
        assert created.command == "CREATE TABLE" and created.columns == []
        inserted = client.databases.query(db.id, "INSERT INTO orders VALUES ($1, $2, $3), ($4, $5, $6)", [1, "apple", 3, 2, "pear", 5])
        assert inserted.row_count == 2
        selected = client.databases.query(db.id, "SELECT id, item, qty FROM orders WHERE qty > $1 ORDER BY id", [2],
                                          broker_token=db.broker_token)
        assert [(c.name, c.type_name) for c in selected.columns] == [("id", "int4"), ("item", "text"), ("qty", "int4")]
        assert selected.rows == [[1, "apple", 3], [2, "pear", 5]] and selected.row_count == 2
        with pytest.raises(clade.BadRequestError, match="42P01"):
            client.databases.query(db.id, "SELECT * FROM no_such_table")

        stats = client.databases.stats(db.id)
        assert stats.postgres_version.startswith("15.") and stats.db_size_bytes > 0 and stats.max_connections > 0
        assert "database system is ready to accept connections" in client.databases.logs(db.id)
        assert client.databases.update(db.id, always_on=True).always_on is True
        assert client.databases.wake(db.id) == "running"

        clone = client.databases.clone(db.id)
        clone_id = clone.id
        assert clone.status == "running" and clone.cloned_from == db.id and clone.label == "orders (clone)"
        assert clone.password != db.password
        assert client.databases.query(clone.id, "SELECT sum(qty) FROM orders").rows == [[8]]
        # Failover rebuilds it from its base backup (taken in the background
        # once it is made) and WAL, in a new sandbox, at the same address.
        deadline = time.monotonic() + 300
        while not client.databases.get(db.id).failover_available:
            assert time.monotonic() < deadline, "no base backup within 300 s"
            time.sleep(0.5)
        rebuilt = client.databases.failover(db.id)
        assert rebuilt.id == db.id and rebuilt.sandbox_id != db.sandbox_id and rebuilt.connection_url == db.connection_url
        assert client.databases.query(db.id, "SELECT sum(qty) FROM orders").rows == [[8]]

        reset = client.databases.reset_credentials(db.id)
        assert reset.broker_token and reset.broker_token != db.broker_token and reset.password != db.password
        with pytest.raises(clade.AuthenticationError):
            client.databases.query(db.id, "SELECT 1", broker_token=db.broker_token)
        assert client.databases.query(db.id, "SELECT count(*) FROM orders", broker_token=reset.broker_token).rows == [[2]]
    finally:
        for database_id in filter(None, [clone_id, db.id]):
            client.databases.delete(database_id)
    for database_id in (clone_id, db.id):
        assert database_id is not None
        with pytest.raises(clade.NotFoundError):
            client.databases.get(database_id)


async def test_a_create_cancelled_while_it_waits_deletes_its_database(server: Server, postgres_ready: None) -> None:
    # In another workspace: a database deleted while it is being made still
    # gets its sandbox, which the server removes a moment later, and the
    # admin workspace's tests count sandboxes.
    key = server.create_key("other")
    # The create is waiting once it polls its database: that is when to cancel it.
    polled: "asyncio.Queue[str]" = asyncio.Queue()

    async def on_request(request: httpx.Request) -> None:
        if request.method == "GET" and request.url.path.startswith("/v1/databases/db-"):
            polled.put_nowait(request.url.path.rsplit("/", 1)[-1])

    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, event_hooks={"request": [on_request]})
    async with clade.AsyncClade(api_key=key, api_url=server.url, http_client=http) as aclient:
        creating = asyncio.create_task(aclient.databases.create(label="cancelled"))
        database_id = await asyncio.wait_for(polled.get(), timeout=60)
        creating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await creating
        with pytest.raises(clade.NotFoundError):
            await aclient.databases.get(database_id)
