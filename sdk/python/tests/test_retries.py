"""Retries, through a loopback proxy between the SDK and the server that
refuses or drops requests on purpose."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, List, Optional

import httpx
import pytest

import clade
from conftest import Server

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


class FaultyProxy:
    """Forwards to the server, but answers the first `refusals` requests with
    `status` and `Retry-After: 1`, or (`drop_first_create`) forwards the first
    `POST /v1/sandboxes` and then closes the connection without an answer.
    `delay` holds every answer back that many seconds (a slow create's)."""

    def __init__(
        self, upstream: str, *, status: int = 503, refusals: int = 0, drop_first_create: bool = False, delay: float = 0.0
    ) -> None:
        self.upstream = upstream
        self.delay = delay
        self.status = status
        self.refusals = refusals
        self.drop_first_create = drop_first_create
        self.seen: List[str] = []
        self.idempotency_keys: List[Optional[str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def handle_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.seen.append(f"{self.command} {self.path}")
                    refuse = proxy.refusals > 0
                    if refuse:
                        proxy.refusals -= 1
                    is_create = self.command == "POST" and self.path == "/v1/sandboxes"
                    if is_create:
                        proxy.idempotency_keys.append(self.headers.get("Idempotency-Key"))
                    drop = is_create and proxy.drop_first_create
                    if drop:
                        proxy.drop_first_create = False
                if refuse:
                    payload = json.dumps({"error": "try again", "request_id": "proxy"}).encode()
                    self.send_response(proxy.status)
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                answer = httpx.request(self.command, proxy.upstream + self.path, headers=headers, content=body, timeout=120)
                time.sleep(proxy.delay)
                if drop:
                    # The server did the work; the client never hears of it.
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.send_response(answer.status_code)
                for name, value in answer.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = handle_any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FaultyProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def proxied(server: Server) -> Iterator[FaultyProxy]:
    with FaultyProxy(server.url) as proxy:
        yield proxy


@pytest.mark.parametrize("status", [503, 429])
def test_refusals_with_retry_after_are_retried_after_waiting(server: Server, status: int) -> None:
    with FaultyProxy(server.url, status=status, refusals=2) as proxy:
        with clade.Clade(api_key=server.admin_key, api_url=proxy.url) as client:
            started = time.monotonic()
            me = client.me()
            waited = time.monotonic() - started
    assert me.workspace.name == "default"
    assert proxy.seen == ["GET /v1/me"] * 3
    assert waited >= 2.0, f"two Retry-After: 1 answers, but the SDK waited {waited:.2f} s"


def test_refusals_past_the_retry_budget_raise(server: Server) -> None:
    with FaultyProxy(server.url, status=503, refusals=5) as proxy:
        with clade.Clade(api_key=server.admin_key, api_url=proxy.url).with_options(max_retries=1) as client:
            with pytest.raises(clade.ServiceUnavailableError) as refused:
                client.me()
    assert refused.value.retry_after == 1 and refused.value.request_id == "proxy"
    assert len(proxy.seen) == 2


def test_a_post_without_idempotency_key_is_not_retried(server: Server, sandbox: clade.Sandbox) -> None:
    with FaultyProxy(server.url, status=503) as proxy:
        with clade.Clade(api_key=server.admin_key, api_url=proxy.url) as client:
            proxied_sandbox = client.sandboxes.get(sandbox.id)
            proxy.refusals = 1
            with pytest.raises(clade.ServiceUnavailableError):
                proxied_sandbox.exec("true")
    assert proxy.seen == [f"GET /v1/sandboxes/{sandbox.id}", f"POST /v1/sandboxes/{sandbox.id}/exec"]


def test_a_create_whose_answer_was_lost_is_retried_with_the_same_key_and_made_once(server: Server, client: clade.Clade) -> None:
    marker = f"lost-answer-{time.time_ns()}"
    with FaultyProxy(server.url, drop_first_create=True) as proxy:
        with clade.Clade(api_key=server.admin_key, api_url=proxy.url) as proxied_client:
            sb = proxied_client.sandboxes.create(metadata={"marker": marker})
    try:
        assert len(proxy.idempotency_keys) == 2 and proxy.idempotency_keys[0] == proxy.idempotency_keys[1]
        assert proxy.idempotency_keys[0]
        mine = [s for s in client.sandboxes.list() if s.metadata.get("marker") == marker]
        assert [s.id for s in mine] == [sb.id]
    finally:
        client.sandboxes.delete(sb.id)


def test_a_create_outlasts_the_clients_timeout_which_bounds_the_other_calls(server: Server, client: clade.Clade) -> None:
    # The first create of a template's shape bakes its snapshot: a minute
    # or more under emulation. The client's timeout must not give up on it.
    with FaultyProxy(server.url, delay=2.0) as proxy:
        with clade.Clade(api_key=server.admin_key, api_url=proxy.url, timeout=1.0, max_retries=0) as slow_client:
            sb = slow_client.sandboxes.create(metadata={"suite": "sdk-python-slow-create"})
            try:
                assert proxy.seen == ["POST /v1/sandboxes"]
                with pytest.raises(clade.APITimeoutError):
                    slow_client.templates.list()
            finally:
                client.sandboxes.delete(sb.id)


async def test_async_client_retries_503_after_waiting(server: Server) -> None:
    with FaultyProxy(server.url, status=503, refusals=1) as proxy:
        async with clade.AsyncClade(api_key=server.admin_key, api_url=proxy.url) as client:
            started = time.monotonic()
            templates = await client.templates.list()
            waited = time.monotonic() - started
    assert "base" in [t.name for t in templates]
    assert waited >= 1.0 and len(proxy.seen) == 2


def test_a_409_with_retry_after_is_retried_only_for_a_keyed_request(server: Server, client: clade.Clade) -> None:
    # The server's answer while a keyed request's first attempt is still
    # running: 409 + Retry-After. The create retries and gets its sandbox.
    with FaultyProxy(server.url, status=409, refusals=1) as proxy:
        with clade.Clade(api_key=server.admin_key, api_url=proxy.url) as proxied_client:
            started = time.monotonic()
            sb = proxied_client.sandboxes.create(metadata={"suite": "sdk-python-409"})
            waited = time.monotonic() - started
            try:
                assert proxy.seen == ["POST /v1/sandboxes"] * 2 and waited >= 1.0
                assert len(set(proxy.idempotency_keys)) == 1
            finally:
                client.sandboxes.delete(sb.id)
            # A POST without a key is a real conflict: not retried.
            proxy.seen.clear()
            proxy.refusals = 1
            with pytest.raises(clade.ConflictError) as conflict:
                proxied_client.keys.create("never-made")
    assert conflict.value.retry_after == 1 and proxy.seen == ["POST /v1/me/tokens"]
