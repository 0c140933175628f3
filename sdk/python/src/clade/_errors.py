"""The SDK's errors: one hierarchy, keyed by HTTP status for the API's
answers, plus connection and timeout errors and a failed command.

Every API error carries the status, the server's `error` message, its
`detail` and the request id (from the body, else the `X-Request-Id`
header), and shows them in its message."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Type

if TYPE_CHECKING:
    from ._generated import DatabaseInfo, DeploymentInfo, FunctionInfo


class CladeError(Exception):
    """Every error this SDK raises."""


class APIError(CladeError):
    """A request that did not get a usable answer."""


class APIConnectionError(APIError):
    """The server could not be reached, or the connection broke."""


class APITimeoutError(APIConnectionError):
    """The request took longer than its timeout; the connection was closed
    (which stops the work on the server: a command is killed)."""


class APIStatusError(APIError):
    """The server answered with an error status."""

    status_code: int = 0

    def __init__(
        self,
        status_code: int,
        error: str,
        *,
        detail: Optional[str] = None,
        request_id: Optional[str] = None,
        body: Optional[Mapping[str, Any]] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        self.status_code = status_code
        self.error = error
        self.detail = detail
        self.request_id = request_id
        self.body: Dict[str, Any] = dict(body or {})
        self.retry_after = retry_after
        super().__init__(self._describe())

    def _describe(self) -> str:
        text = f"{self.status_code} {self.error}"
        if self.detail:
            text += f": {self.detail}"
        for extra in ("reason", "hint"):
            if self.body.get(extra):
                text += f" ({extra}: {self.body[extra]})"
        if self.request_id:
            text += f" [request_id {self.request_id}]"
        return text


class BadRequestError(APIStatusError):
    status_code = 400


class AuthenticationError(APIStatusError):
    status_code = 401


class PermissionDeniedError(APIStatusError):
    status_code = 403


class NotFoundError(APIStatusError):
    status_code = 404


class ConflictError(APIStatusError):
    status_code = 409


class PayloadTooLargeError(APIStatusError):
    status_code = 413


class UnprocessableEntityError(APIStatusError):
    status_code = 422


class RateLimitedError(APIStatusError):
    status_code = 429


class InternalServerError(APIStatusError):
    """Any 5xx."""

    status_code = 500


class ServiceUnavailableError(InternalServerError):
    status_code = 503


class GatewayTimeoutError(InternalServerError):
    """A command or a cell ran past its timeout and was killed (504)."""

    status_code = 504


class InsufficientStorageError(InternalServerError):
    """The host cannot hold what was asked (507); not retried."""

    status_code = 507


class CommandFailedError(CladeError):
    """A command run with `check=True` exited with a non-zero code."""

    def __init__(self, command: str, exit_code: int, stdout: str, stderr: str) -> None:
        self.command = command
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        tail = stderr.strip().splitlines()[-5:]
        message = f"command exited with {exit_code}: {command}"
        if tail:
            message += "\n" + "\n".join(tail)
        super().__init__(message)


class StreamError(CladeError):
    """A stream ended with an error event, or before its last event."""


class DatabaseFailedError(CladeError):
    """A database being waited for ended `failed`; `database.error` says why."""

    def __init__(self, database: DatabaseInfo) -> None:
        self.database = database
        super().__init__(f"database {database.id} failed: {database.error or 'no reason given'}")


class DatabaseTimeoutError(CladeError):
    """A database was not ready within the wait's timeout. It is not deleted:
    `database` is what the server last said of it, and waiting again may
    still see it ready."""

    def __init__(self, database: DatabaseInfo, timeout: float) -> None:
        self.database = database
        self.timeout = timeout
        super().__init__(f"database {database.id} is still {database.status} after {timeout:g} s")


class FunctionDeployError(CladeError):
    """A function's deploy ended `failed`. `function` is what the server said
    of it, `error` why, and `deploy_log` the end of its install's output. The
    version before it, if it had one, still runs."""

    def __init__(self, function: FunctionInfo) -> None:
        self.function = function
        self.error = function.error
        self.deploy_log = function.deploy_log
        message = f"function {function.id} (version {function.version}) failed to deploy: {function.error or 'no reason given'}"
        tail = (function.deploy_log or "").strip().splitlines()[-5:]
        if tail:
            message += "\n" + "\n".join(tail)
        super().__init__(message)


class FunctionDeployTimeoutError(CladeError):
    """A function's deploy had not ended within the wait's timeout. It goes
    on: `function` is what the server last said of it, and waiting again
    may still see it ready."""

    def __init__(self, function: FunctionInfo, timeout: float) -> None:
        self.function = function
        self.timeout = timeout
        super().__init__(f"function {function.id} is still {function.status} after {timeout:g} s")


class AppDeployError(CladeError):
    """An app's deployment ended `failed`. `deployment` is what the server
    said of it, `error` why, and `build_logs` what its steps printed. The
    deployment live before it, if any, still serves the app."""

    def __init__(self, deployment: DeploymentInfo) -> None:
        self.deployment = deployment
        self.error = deployment.error
        self.build_logs = deployment.build_logs
        message = f"deployment {deployment.id} of app {deployment.app_id} failed: {deployment.error or 'no reason given'}"
        tail = (deployment.build_logs or "").strip().splitlines()[-5:]
        if tail:
            message += "\n" + "\n".join(tail)
        super().__init__(message)


class AppDeployTimeoutError(CladeError):
    """An app's deployment had not ended within the wait's timeout. It goes
    on: `deployment` is what the server last said of it, and waiting again
    may still see it live."""

    def __init__(self, deployment: DeploymentInfo, timeout: float) -> None:
        self.deployment = deployment
        self.timeout = timeout
        super().__init__(f"deployment {deployment.id} of app {deployment.app_id} is still {deployment.status} after {timeout:g} s")


_BY_STATUS: Dict[int, Type[APIStatusError]] = {
    cls.status_code: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        ConflictError,
        PayloadTooLargeError,
        UnprocessableEntityError,
        RateLimitedError,
        ServiceUnavailableError,
        GatewayTimeoutError,
        InsufficientStorageError,
    )
}


def status_error(
    status_code: int, content: bytes, headers: Mapping[str, str], retry_after: Optional[float] = None
) -> APIStatusError:
    """The error of an answer with an error status (§2.4's flat body)."""
    body: Dict[str, Any] = {}
    try:
        decoded = json.loads(content.decode("utf-8", "replace")) if content else {}
        if isinstance(decoded, dict):
            body = decoded
    except ValueError:
        pass
    message = body.get("error")
    if not isinstance(message, str) or not message:
        message = content.decode("utf-8", "replace").strip()[:500] or f"HTTP {status_code}"
    request_id = body.get("request_id") or headers.get("x-request-id")
    detail = body.get("detail") if isinstance(body.get("detail"), str) else None
    if status_code in _BY_STATUS:
        cls = _BY_STATUS[status_code]
    elif status_code >= 500:
        cls = InternalServerError
    else:
        cls = APIStatusError
    return cls(status_code, message, detail=detail, request_id=request_id, body=body, retry_after=retry_after)
