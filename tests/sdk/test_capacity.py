"""Capacity (§2.6): a create the host has no room for is refused with 503,
Retry-After and a flat JSON error, before anything is made; the SDK waits
and retries it within its budget, and it succeeds once room is made."""

import time

import pandastack
import pytest

from conftest import TEMPLATE

# How a server is told to run at most one sandbox (`clade server --max-running`).
ONE_SANDBOX = {"CLADE_MAX_RUNNING": "1"}


def test_create_is_retried_after_503_retry_after(start_server):
    server = start_server("capacity", env=ONE_SANDBOX)
    events = []
    holder = {}

    def on_retry(event):
        events.append(event)
        if len(events) == 1:
            holder["first"].kill()  # room for the retry

    client = server.client(on_create_retry=on_retry, max_create_retry_seconds=60)
    holder["first"] = client.sandboxes.create(template=TEMPLATE)

    # Without a retry budget the refusal surfaces as it is.
    impatient = server.client(max_create_retry_seconds=0)
    with pytest.raises(pandastack.ServerError, match="no compute capacity available"):
        impatient.sandboxes.create(template=TEMPLATE)

    started = time.monotonic()
    second = client.sandboxes.create(template=TEMPLATE)
    waited = time.monotonic() - started
    try:
        assert second.status == "running"
        assert len(events) == 1, events
        event = events[0]
        assert (event.method, event.path, event.status_code) == ("POST", "/sandboxes", 503)
        assert event.error == "no compute capacity available"
        assert event.retry_after_seconds is not None and event.retry_after_seconds >= 1
        assert waited >= event.retry_after_seconds
        # Nothing was made by the refused attempts.
        assert [s.id for s in client.sandboxes.list()] == [second.id]
    finally:
        second.kill()
