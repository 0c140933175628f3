"""Schemathesis hooks of test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

They steer generated requests so that the run reaches real handlers without
wrecking its own fixture: most sandbox-scoped requests target the real
sandbox named by CLADE_FUZZ_SANDBOX (the rest keep their random id: 404s),
file operations stay under /tmp/fuzz in the guest, commands time out within
10 s, the real sandbox keeps an idle TTL of at least an hour and limits its
commands can run under, and logs and events are not followed (a followed
stream never ends), and an app's git URL is a loopback address where nothing
listens (a deployment's fetch fails at once, and nothing leaves the
machine). Deleting the real sandbox is left
to random ids, and so is revoking the admin key (schemathesis reuses values
from earlier answers, such as the key prefixes `GET /v1/me/tokens` lists,
and a key may revoke itself). Each steer keeps the value's kind (an out-of-range or
wrong-typed value still goes out as generated).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import zlib

import schemathesis

SANDBOX = os.environ.get("CLADE_FUZZ_SANDBOX", "")
ADMIN_PREFIX = os.environ.get("CLADE_FUZZ_ADMIN_PREFIX", "")
FS_ROOT = "/tmp/fuzz"
# Port 9 (discard) of loopback: nothing listens there.
LOOPBACK_REPO = "https://127.0.0.1:9/fuzz.git"


def _real_sandbox(path: str, method: str, generated) -> bool:
    if not SANDBOX or not path.startswith("/v1/sandboxes/{id}"):
        return False
    if path == "/v1/sandboxes/{id}" and method == "DELETE":
        return False
    # Three in four, chosen by the generated id so a replayed case stays the same.
    return zlib.crc32(repr(generated).encode()) % 4 != 0


@schemathesis.hook
def before_call(context, case, kwargs):
    path = case.operation.path
    method = case.method.upper()
    params = case.path_parameters if isinstance(case.path_parameters, dict) else None
    if params is not None and "id" in params:
        if _real_sandbox(path, method, params["id"]):
            params["id"] = SANDBOX
        elif path == "/v1/sandboxes/{id}" and method == "DELETE" and params["id"] == SANDBOX:
            params["id"] = "not-" + SANDBOX
    if params is not None and path == "/v1/me/tokens/{prefix}" and ADMIN_PREFIX and params.get("prefix") == ADMIN_PREFIX:
        params["prefix"] = "not-" + ADMIN_PREFIX
    query = case.query if isinstance(case.query, dict) else None
    if query is not None:
        if path.startswith("/v1/sandboxes/{id}/fs") and isinstance(query.get("path"), str) and query["path"].startswith("/"):
            query["path"] = FS_ROOT + query["path"]
        if path.endswith(("/logs", "/events")) and "follow" in query:
            query["follow"] = "0"
    body = case.body if isinstance(case.body, dict) else None
    if body is not None:
        if path in ("/v1/apps", "/v1/apps/{id}") and isinstance(body.get("git_url"), str):
            body["git_url"] = LOOPBACK_REPO
        timeout = body.get("timeout_seconds")
        if path.endswith(("/exec", "/exec/stream")) and isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 10:
            if timeout <= 86400:
                body["timeout_seconds"] = 10
        ttl = body.get("ttl_seconds")
        if path.endswith("/lifecycle") and isinstance(ttl, int) and not isinstance(ttl, bool) and 0 < ttl < 3600:
            body["ttl_seconds"] = 3600
        # Limits the real sandbox's later commands can live with (in range, still set).
        if path.endswith("/limits"):
            for key, least in (("memory_mb", 128), ("max_processes", 64)):
                value = body.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and 0 < value < least:
                    body[key] = least


# The 5xx the API documents as refusals, not failures: 503 from the
# scheduler (with Retry-After), 507 from host admission, 504 for a
# command that outran its timeout, and 502 from the port proxy when nothing
# listens on the port. Any other 5xx fails the run.
ALLOWED_5XX = {
    503: lambda response: "retry-after" in {k.lower() for k in response.headers},
    507: lambda response: True,
}


# Every status this run received, written at exit to CLADE_FUZZ_STATS for
# the test's summary (the checks below see every response).
STATUSES: "collections.Counter[int]" = collections.Counter()
STATS = os.environ.get("CLADE_FUZZ_STATS", "")


@atexit.register
def _write_statuses() -> None:
    if STATS:
        with open(STATS, "w") as out:
            json.dump({str(status): count for status, count in sorted(STATUSES.items())}, out)


@schemathesis.check
def no_undocumented_server_error(ctx, response, case):
    status = response.status_code
    STATUSES[status] += 1
    if status < 500:
        return None
    allowed = ALLOWED_5XX.get(status)
    if allowed is not None and allowed(response):
        return None
    if status == 504 and case.operation.path.endswith("/exec") and "deadline exceeded" in response.text:
        return None
    # The port proxy's documented 502: nothing listens on that port in the sandbox.
    port_route = "/proxy/{port}" in case.operation.path or case.operation.path.endswith("/ports/{port}/connect")
    if status == 502 and port_route and "nothing is listening on port" in response.text:
        return None
    raise AssertionError(f"server error {status} from {case.method} {case.formatted_path}: {response.text[:500]}")
