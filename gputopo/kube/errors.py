"""Typed Kubernetes API errors.

Callers branch on the class (NotFound, Conflict, Gone, ...) instead of on HTTP numbers, and every error keeps the
apiserver's Status body so logs show exactly what the server said.
"""

from __future__ import annotations

import socket
from typing import Any

import orjson
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException


class KubeArgumentError(ValueError):
    """A caller passed something the apiserver would reject anyway (wrong types, empty names)."""


class KubeApiError(Exception):
    """An apiserver call failed. `status` is the HTTP code (0 when no answer came), `reason` the Status reason."""

    retryable: bool = False
    # Whether the apiserver may still apply the request, when whoever saw the failure decided it already (a bind
    # refused before it was sent: not applied).
    applied: bool | None = None

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        body: dict[str, Any] | None = None,
        *,
        operation: str = "",
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body
        self.operation = operation
        where = f"{operation}: " if operation else ""
        super().__init__(f"{where}{status} {reason}: {message}")


class BadRequest(KubeApiError):
    """400: the request itself was malformed (bad selector, undecodable patch, name mismatch)."""


class Unauthorized(KubeApiError):
    """401: the credentials were not accepted."""


class Forbidden(KubeApiError):
    """403: authenticated but RBAC does not allow this verb on this resource."""


class NotFound(KubeApiError):
    """404: the object (or the API path) does not exist."""


class Conflict(KubeApiError):
    """409: optimistic-concurrency or binding conflict (already bound, stale resourceVersion, uid mismatch)."""


class Gone(KubeApiError):
    """410: the resourceVersion or continue token is older than the server keeps; re-list."""


class UnsupportedMediaType(KubeApiError):
    """415: the patch Content-Type is not one the server accepts."""


class Invalid(KubeApiError):
    """422: the request decoded but the resulting object fails validation."""


class TooManyRequests(KubeApiError):
    """429: API priority and fairness throttled us; retry later."""

    retryable = True


class ServerError(KubeApiError):
    """5xx: the apiserver failed; retry later."""

    retryable = True


class ApiUnavailable(KubeApiError):
    """No HTTP answer at all: connection refused/reset, timeout, broken stream."""

    retryable = True


_BY_STATUS: dict[int, type[KubeApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    415: UnsupportedMediaType,
    422: Invalid,
    429: TooManyRequests,
}


def error_class_for(status: int) -> type[KubeApiError]:
    """The KubeApiError subclass for an HTTP status code."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return ServerError
    if status == 0:
        return ApiUnavailable
    return KubeApiError


def error_from_status(
    status_obj: Any, *, http_status: int = 0, http_reason: str = "", operation: str = ""
) -> KubeApiError:
    """Build the typed error for a Status object (an error reply body, or a watch ERROR event's object)."""
    body = status_obj if isinstance(status_obj, dict) else None
    code = http_status
    reason = http_reason
    message = ""
    if body is not None:
        raw_code = body.get("code")
        if isinstance(raw_code, int) and raw_code > 0:
            code = raw_code
        reason = str(body.get("reason") or reason or "")
        message = str(body.get("message") or "")
    if not message:
        message = reason or "no message in reply"
    return error_class_for(code)(code, reason or "Unknown", message, body, operation=operation)


def _decode_body(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        parsed = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def error_from_api_exception(exc: ApiException, *, operation: str = "") -> KubeApiError:
    """Convert the official client's ApiException (status 0 means it never got a reply) into our typed error."""
    status = int(exc.status or 0)
    body = _decode_body(exc.body)
    if status == 0:
        return ApiUnavailable(0, "ConnectionFailed", str(exc.reason or exc), body, operation=operation)
    if body is None:
        text = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
        return error_class_for(status)(
            status, str(exc.reason or "Unknown"), text.strip() or str(exc.reason), None, operation=operation
        )
    return error_from_status(body, http_status=status, http_reason=str(exc.reason or ""), operation=operation)


def to_kube_error(exc: BaseException, *, operation: str = "") -> KubeApiError | None:
    """Typed error for anything a client call can raise on the wire; None for programming errors (re-raise those)."""
    if isinstance(exc, KubeApiError):
        return exc
    if isinstance(exc, ApiException):
        return error_from_api_exception(exc, operation=operation)
    if isinstance(exc, (urllib3.exceptions.HTTPError, socket.timeout, ConnectionError, OSError)):
        return ApiUnavailable(0, type(exc).__name__, str(exc) or type(exc).__name__, None, operation=operation)
    return None


def may_have_applied(err: KubeApiError) -> bool:
    """Whether the apiserver may have applied a request that did not succeed: no answer came after the request was
    sent (read timeout, connection cut), or 504 (the apiserver's own timeout: it may still be processing it). A
    connection that was never made sent nothing."""
    if err.applied is not None:
        return err.applied
    if isinstance(err, ApiUnavailable):
        cause = err.__cause__
        cause = getattr(cause, "reason", None) or cause  # MaxRetryError wraps the last failure
        return not isinstance(cause, urllib3.exceptions.ConnectTimeoutError)  # NewConnectionError is one
    return err.status == 504
