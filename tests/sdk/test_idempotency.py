"""`Idempotency-Key` through the unmodified SDK: the SDK sends whatever
headers its `requests` session carries, so a client given a key is a client
whose retries are safe. A retry gets the first answer and makes nothing
more; a key reused for another request is refused (422); a retry after the
server was killed mid-create, on the restarted server, ends with exactly
one sandbox."""

import sqlite3
import threading
import time
import uuid

import pytest
from pandastack import BadRequestError, PandastackError

from conftest import TEMPLATE, wait_for


def keyed(server, key):
    """A client of the server whose every request carries `key`."""
    client = server.client()
    client.session.headers["Idempotency-Key"] = key
    return client


def tagged(client, tag):
    return [s.id for s in client.sandboxes.list() if (s.metadata or {}).get("tag") == tag]


def test_a_retried_create_gets_the_first_sandbox_and_makes_no_other(server, client):
    key = str(uuid.uuid4())
    tag = f"idem-{key[:8]}"
    first = keyed(server, key).sandboxes.create(template=TEMPLATE, metadata={"tag": tag})
    try:
        retry = keyed(server, key).sandboxes.create(template=TEMPLATE, metadata={"tag": tag})
        assert retry.id == first.id
        assert retry.exec("echo same").stdout == "same\n"
        assert tagged(client, tag) == [first.id]
        with pytest.raises(BadRequestError, match="different request"):
            keyed(server, key).sandboxes.create(template=TEMPLATE, metadata={"tag": "another"})
    finally:
        first.kill()


def test_a_retry_after_the_server_died_mid_create_ends_with_one_sandbox(start_server):
    server = start_server("idempotency-kill")
    key = str(uuid.uuid4())
    tag = f"killed-{key[:8]}"
    database = server.data_dir / "clade.db"

    def pending():
        try:
            with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=1) as db:
                return db.execute("SELECT state FROM idempotency_keys WHERE idem_key = ?", (key,)).fetchone() == ("pending",)
        except sqlite3.Error:
            return False

    outcome = {}

    def first_attempt():
        try:
            outcome["sandbox"] = keyed(server, key).sandboxes.create(template=TEMPLATE, metadata={"tag": tag})
        except PandastackError as e:
            outcome["error"] = e

    attempt = threading.Thread(target=first_attempt)
    attempt.start()
    wait_for(pending, timeout=60, interval=0.005, what="the create to hold its key")
    server.kill()
    attempt.join(60)
    assert "error" in outcome or "sandbox" in outcome

    server.start()
    started = time.monotonic()
    retried = keyed(server, key).sandboxes.create(template=TEMPLATE, metadata={"tag": tag})
    waited = time.monotonic() - started
    print(f"retry answered after {waited:.1f} s; first attempt: {sorted(outcome)}")
    try:
        assert tagged(server.client(), tag) == [retried.id], f"after a wait of {waited:.1f} s"
        assert retried.exec("echo alive").stdout == "alive\n"
    finally:
        retried.kill()
