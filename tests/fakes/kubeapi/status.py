"""Status bodies as the kube-apiserver writes them (key order included), and the exception that answers with one.

Wording and shapes follow the recorded exchanges in fixtures/recordings/kube-apiserver.
"""

from __future__ import annotations

from tests.fakes.kubeapi.objects import Obj


class ApiError(Exception):
    """Raised inside the fake to answer with a Status body."""

    def __init__(self, status: Obj, headers: dict[str, str] | None = None) -> None:
        super().__init__(status.get("message", ""))
        self.status = status
        self.headers = headers or {}


def status_failure(code: int, reason: str, message: str, details: Obj | None = None,
                   metadata: Obj | None = None) -> Obj:
    body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": metadata or {}, "status": "Failure",
                 "message": message, "reason": reason}
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def status_success(code: int = 200, details: Obj | None = None) -> Obj:
    body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def not_found(resource: str, name: str) -> Obj:
    return status_failure(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


def conflict(resource: str, name: str, why: str) -> Obj:
    return status_failure(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": {why}',
                          {"name": name, "kind": resource})


def bad_request(message: str) -> Obj:
    return status_failure(400, "BadRequest", message)


def invalid(kind: str, name: str, causes: list[tuple[str, str, str]]) -> Obj:
    """422 with (reason, field, message) causes, worded like the apiserver's field errors."""
    summary = ", ".join(f"{fld}: {msg}" for _, fld, msg in causes)
    return status_failure(
        422, "Invalid", f'{kind} "{name}" is invalid: {summary}',
        {"name": name, "kind": kind,
         "causes": [{"reason": r, "message": m, "field": f} for r, f, m in causes]},
    )


def unprocessable(message: str) -> Obj:
    """The generic 422 the apiserver sends when a JSON patch cannot be applied."""
    return status_failure(422, "Invalid", "the server rejected our request due to an error in our request",
                          {"causes": [{"reason": "UnexpectedServerResponse", "message": message}]})


_FAULT_REASONS = {
    400: ("BadRequest", "injected fault"),
    401: ("Unauthorized", "Unauthorized"),
    403: ("Forbidden", "forbidden: injected fault"),
    404: ("NotFound", "the server could not find the requested resource"),
    409: ("Conflict", "injected conflict"),
    410: ("Expired", "too old resource version"),
    422: ("Invalid", "injected fault"),
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: injected fault"),
    503: ("ServiceUnavailable", "The server is currently unable to handle the request"),
    504: ("Timeout", "The server was unable to return a response in the time allotted"),
}


def fault_status(code: int) -> Obj:
    reason, message = _FAULT_REASONS.get(code, ("Unknown", f"injected fault {code}"))
    details: Obj | None = None
    if code == 500:
        details = {"causes": [{"message": "injected fault"}]}
    elif code == 429:
        details = {"retryAfterSeconds": 1}
    return status_failure(code, reason, message, details)


def no_resource() -> Obj:
    return status_failure(404, "NotFound", "the server could not find the requested resource", {})


def method_not_allowed() -> Obj:
    return status_failure(405, "MethodNotAllowed",
                          "the server does not allow this method on the requested resource", {})
