"""An in-process kube-apiserver for tests: real HTTP on 127.0.0.1, real Kubernetes JSON, Nodes and Pods only.

Shapes (Status bodies, list metadata, watch events, bookmarks, 410 inside a watch, chunked bodies over 2 KiB) copy
the kube-apiserver v1.36.2 exchanges recorded in ../shared/recordings/kube-apiserver. Tests drive it through the
official client (never by patching the client), set state with add_*/update_*/delete_*, read `requests` for RBAC
proofs, and inject faults (fail_next, delay_next, expire_history, drop_watches, send_raw_watch_line).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import email.utils
import re
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

import orjson

Obj = dict[str, Any]

FLOWSCHEMA_UID = "0189922a-dd34-436b-b1b0-250896ff29e9"
PRIORITYLEVEL_UID = "a34983b7-6af4-4da5-8fee-55ff568bfebe"
MAX_CONTENT_LENGTH_BODY = 2048  # Go's net/http: bigger bodies go chunked
ANNOTATIONS_MAX_BYTES = 262144

PATCH_TYPES = (
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/json-patch+json",
)

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_KEY_NAME_RE = re.compile(_NAME)
_DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
_KEY_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)

NODE_FIELDS = ("metadata.name", "spec.unschedulable")
POD_FIELDS = (
    "metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
    "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName",
)
_POD_MUTABLE_SPEC = ("containers", "initContainers", "activeDeadlineSeconds", "tolerations",
                     "terminationGracePeriodSeconds")

NODE_BOOKMARK_STATUS: Obj = {
    "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
    "nodeInfo": {
        "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "", "osImage": "",
        "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "", "operatingSystem": "",
        "architecture": "",
    },
}


class RecordedRequest(NamedTuple):
    """One request the fake received: query is the decoded query string (last value wins)."""

    method: str
    path: str
    query: dict[str, str]


class ApiError(Exception):
    """Raised inside the fake to answer with a Status body."""

    def __init__(self, status: Obj, headers: dict[str, str] | None = None) -> None:
        super().__init__(status.get("message", ""))
        self.status = status
        self.headers = headers or {}


# ---------------------------------------------------------------------------------------------------------------
# Status bodies (key order as the apiserver writes them)


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


# ---------------------------------------------------------------------------------------------------------------
# Selectors


@dataclass(frozen=True)
class _LabelReq:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("=", "in"):
            return has and labels[self.key] in self.values
        return not has or labels[self.key] not in self.values  # "!=" and "notin"


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _check_key(key: str) -> str | None:
    if not key:
        return "found '', expected: identifier"
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.fullmatch(prefix)):
        return f"invalid label key \"{key}\": prefix part must be a valid DNS subdomain"
    if not name or len(name) > 63 or not _KEY_NAME_RE.fullmatch(name):
        bad = next((c for c in key if c in "()!=<>"), None)
        if bad:
            return f"found '{bad}', expected: identifier"
        return f"invalid label key \"{key}\": {_KEY_MSG}"
    return None


def _check_value(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE_RE.fullmatch(value):
        bad = next((c for c in value if c in "()!=<>,"), None)
        if bad:
            return f"found '{bad}', expected: identifier"
        return f"invalid label value: \"{value}\": at key: {_LABEL_VALUE_MSG}"
    return None


def parse_label_selector(text: str) -> list[_LabelReq]:
    """labelSelector grammar: k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b); comma means AND."""
    reqs: list[_LabelReq] = []
    if not text.strip():
        return reqs
    for raw in _split_top(text):
        part = raw.strip()
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s*\((.*)\)", part)
        if m:
            key, op, vals = m.group(1), m.group(2), [v.strip() for v in m.group(3).split(",")]
            errs = [_check_key(key), *(_check_value(v) for v in vals)]
        elif part.startswith("!"):
            key, op, vals = part[1:].strip(), "!", []
            errs = [_check_key(key)]
        else:
            m = re.fullmatch(r"([^=!\s]*)\s*(==|!=|=)\s*(.*)", part)
            if m:
                key, op, vals = m.group(1), ("=" if m.group(2) == "==" else m.group(2)), [m.group(3).strip()]
                errs = [_check_key(key), _check_value(vals[0])]
            else:
                key, op, vals = part, "exists", []
                errs = [_check_key(key)]
        err = next((e for e in errs if e), None)
        if err:
            raise ApiError(bad_request(f"unable to parse requirement: {err}"))
        reqs.append(_LabelReq(key, op, frozenset(vals)))
    return reqs


@dataclass(frozen=True)
class _FieldReq:
    path: str
    equal: bool
    value: str


def parse_field_selector(text: str, resource: str) -> list[_FieldReq]:
    allowed = NODE_FIELDS if resource == "nodes" else POD_FIELDS
    reqs: list[_FieldReq] = []
    if not text.strip():
        return reqs
    for raw in text.split(","):
        part = raw.strip()
        m = re.fullmatch(r"([^=!]+)(==|!=|=)(.*)", part)
        if not m:
            raise ApiError(bad_request(f"invalid selector: '{part}'; can't understand '{part}'"))
        path, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if path not in allowed:
            raise ApiError(bad_request(f"field label not supported: {path}"))
        reqs.append(_FieldReq(path, op != "!=", value))
    return reqs


def _field_value(obj: Obj, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if cur is None:
        return "false" if path in ("spec.unschedulable", "spec.hostNetwork") else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


@dataclass(frozen=True)
class Selector:
    """What one list/watch request selects: namespace, label and field requirements."""

    namespace: str | None = None
    labels: tuple[_LabelReq, ...] = ()
    fields: tuple[_FieldReq, ...] = ()

    @property
    def filtered(self) -> bool:
        return bool(self.labels or self.fields)

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((_field_value(obj, f.path) == f.value) == f.equal for f in self.fields)


# ---------------------------------------------------------------------------------------------------------------
# Patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (returns a new value; inputs are not changed)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise ValueError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]] if path else []


def json_patch(doc: Obj, ops: list[Any]) -> Obj:
    """RFC 6902 add/remove/replace/test (on a copy). Raises ValueError with jsonpatch-like messages."""
    doc = _copy(doc)
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise ValueError(f"invalid operation {op!r}")
        kind, path = op["op"], op.get("path")
        parts = _pointer(path)
        if not parts:
            raise ValueError(f"jsonpatch {kind} operation does not apply: cannot change the root document")
        parent: Any = doc
        for p in parts[:-1]:
            if isinstance(parent, dict) and p in parent:
                parent = parent[p]
            elif isinstance(parent, list) and p.isdigit() and int(p) < len(parent):
                parent = parent[int(p)]
            else:
                raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing path: \"{path}\"")
        last = parts[-1]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise ValueError(f"jsonpatch {kind} operation missing value")
        if isinstance(parent, dict):
            exists = last in parent
            if kind == "add":
                parent[last] = op["value"]
            elif not exists:
                raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing key: {path}")
            elif kind == "replace":
                parent[last] = op["value"]
            elif kind == "remove":
                del parent[last]
            elif kind == "test":
                if parent[last] != op["value"]:
                    raise ValueError(f"testing value {path} failed: test failed")
            else:
                raise ValueError(f"Unexpected kind: {kind}")
        elif isinstance(parent, list):
            if kind == "add" and last == "-":
                parent.append(op["value"])
                continue
            if not last.isdigit() or int(last) > len(parent) or (kind != "add" and int(last) == len(parent)):
                raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing path: \"{path}\"")
            idx = int(last)
            if kind == "add":
                parent.insert(idx, op["value"])
            elif kind == "replace":
                parent[idx] = op["value"]
            elif kind == "remove":
                del parent[idx]
            elif kind == "test":
                if parent[idx] != op["value"]:
                    raise ValueError(f"testing value {path} failed: test failed")
            else:
                raise ValueError(f"Unexpected kind: {kind}")
        else:
            raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing path: \"{path}\"")
    return doc


def _copy(obj: Any) -> Any:
    return orjson.loads(orjson.dumps(obj))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def validate_metadata(kind: str, obj: Obj) -> list[tuple[str, str, str]]:
    """Field errors for labels/annotations, worded like the apiserver's."""
    causes: list[tuple[str, str, str]] = []
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return [("FieldValueInvalid", "metadata", "Invalid value: must be an object")]
    for fld in ("labels", "annotations"):
        values = meta.get(fld)
        if values is None:
            continue
        if not isinstance(values, dict):
            causes.append(("FieldValueInvalid", f"metadata.{fld}", f"Invalid value: {values!r}: must be a map"))
            continue
        for key, value in values.items():
            err = _check_key(key)
            if err:
                causes.append(("FieldValueInvalid", f"metadata.{fld}", f'Invalid value: "{key}": {err}'))
            if not isinstance(value, str):
                causes.append(("FieldValueInvalid", f"metadata.{fld}",
                               f"Invalid value: {value!r}: must be a string"))
            elif fld == "labels" and _check_value(value):
                causes.append(("FieldValueInvalid", "metadata.labels",
                               f'Invalid value: "{value}": {_LABEL_VALUE_MSG}'))
        if fld == "annotations" and not causes:
            size = sum(len(k) + len(v) for k, v in values.items())
            if size > ANNOTATIONS_MAX_BYTES:
                causes.append(("FieldValueTooLong", "metadata.annotations",
                               f"Too long: may not be more than {ANNOTATIONS_MAX_BYTES} bytes"))
    return causes


# ---------------------------------------------------------------------------------------------------------------
# Store, history, watches


class _Event(NamedTuple):
    rv: int
    resource: str
    type: str
    obj: Obj
    old: Obj | None


@dataclass
class _Fault:
    remaining: int
    status: int
    pattern: re.Pattern[str] | None
    method: str | None


@dataclass
class _Delay:
    remaining: int
    seconds: float
    pattern: re.Pattern[str] | None
    gate: threading.Event | None = None


@dataclass
class _Stream:
    resource: str
    selector: Selector
    bookmarks: bool
    sock: socket.socket
    raw_lines: list[tuple[int, bytes]] = field(default_factory=list)  # (rv when injected, line)
    dropped: bool = False


def _key(resource: str, obj: Obj) -> str:
    meta = obj["metadata"]
    return meta["name"] if resource == "nodes" else f"{meta['namespace']}/{meta['name']}"


def _list_item(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _with_rv(obj: Obj, rv: int) -> Obj:
    new = dict(obj)
    new["metadata"] = dict(obj["metadata"], resourceVersion=str(rv))
    return new


class FakeKubeApi:
    """The fake apiserver. Use as a context manager; `url` is http://127.0.0.1:<port>."""

    def __init__(self, *, token: str | None = None, history_limit: int = 10_000, first_rv: int = 100) -> None:
        self.token = token
        self.history_limit = history_limit
        self.requests: list[RecordedRequest] = []
        self._cond = threading.Condition(threading.RLock())
        self._rv = first_rv
        self._store: dict[str, dict[str, Obj]] = {"nodes": {}, "pods": {}}
        self._history: deque[_Event] = deque()
        self._trimmed_upto = 0  # highest rv dropped from history
        self._compacted_upto = 0  # expire_history(): watches/continues from older rvs get 410
        self._snapshots: dict[tuple[str, int], list[tuple[str, Obj]]] = {}
        self._faults: list[_Fault] = []
        self._delays: list[_Delay] = []
        self._streams: list[_Stream] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        if self._server is not None:
            raise RuntimeError("FakeKubeApi already started")
        self._stopping.clear()
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._serve_thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                              name="fake-kubeapi", daemon=True)
        self._serve_thread.start()
        return self

    def stop(self) -> None:
        server = self._server
        if server is None:
            return
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        server.shutdown()
        server.close_all()
        server.server_close()
        if self._serve_thread is not None:
            self._serve_thread.join(5)
        self._server = None
        self._serve_thread = None

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeKubeApi not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._rv)

    # -- test-facing state -----------------------------------------------------------------------------------

    def add_node(self, obj: Obj) -> Obj:
        return _copy(self._create("nodes", obj))

    def add_pod(self, obj: Obj) -> Obj:
        return _copy(self._create("pods", obj))

    def update_node(self, name: str, change: Obj | Callable[[Obj], Obj | None]) -> Obj:
        """Apply a merge-patch dict, or a function that edits (or returns) a copy of the node."""
        return _copy(self._update("nodes", name, change))

    def update_pod(self, namespace: str, name: str, change: Obj | Callable[[Obj], Obj | None]) -> Obj:
        return _copy(self._update("pods", f"{namespace}/{name}", change))

    def delete_node(self, name: str) -> Obj:
        return _copy(self._delete("nodes", name))

    def delete_pod(self, namespace: str, name: str) -> Obj:
        return _copy(self._delete("pods", f"{namespace}/{name}"))

    def node(self, name: str) -> Obj | None:
        with self._cond:
            obj = self._store["nodes"].get(name)
        return _copy(obj) if obj is not None else None

    def pod(self, namespace: str, name: str) -> Obj | None:
        with self._cond:
            obj = self._store["pods"].get(f"{namespace}/{name}")
        return _copy(obj) if obj is not None else None

    def nodes(self) -> list[Obj]:
        with self._cond:
            return [_copy(o) for _, o in sorted(self._store["nodes"].items())]

    def pods(self) -> list[Obj]:
        with self._cond:
            return [_copy(o) for _, o in sorted(self._store["pods"].items())]

    def clear_requests(self) -> None:
        with self._cond:
            self.requests.clear()

    # -- fault injection -------------------------------------------------------------------------------------

    def fail_next(self, n: int = 1, status: int = 500, path_regex: str | None = None,
                  method: str | None = None) -> None:
        """The next n requests whose 'path?query' matches path_regex (search) get a Status error `status`."""
        with self._cond:
            self._faults.append(_Fault(n, status, re.compile(path_regex) if path_regex else None,
                                       method.upper() if method else None))

    def delay_next(self, n: int, seconds: float, path_regex: str | None = None) -> None:
        """The next n matching requests wait `seconds` before being served."""
        with self._cond:
            self._delays.append(_Delay(n, seconds, re.compile(path_regex) if path_regex else None))

    def hold_next(self, n: int = 1, path_regex: str | None = None) -> threading.Event:
        """The next n matching requests are recorded, then wait until the returned event is set (or stop())."""
        gate = threading.Event()
        with self._cond:
            self._delays.append(_Delay(n, 0.0, re.compile(path_regex) if path_regex else None, gate))
        return gate

    def expire_history(self) -> None:
        """Compact: watches and continue tokens from any resourceVersion older than now get 410 Expired."""
        with self._cond:
            self._compacted_upto = self._rv
            self._snapshots.clear()

    def drop_watches(self) -> int:
        """Abruptly close every open watch stream (no terminating chunk). Returns how many."""
        with self._cond:
            streams = list(self._streams)
            for s in streams:
                s.dropped = True
            self._cond.notify_all()
        for s in streams:
            _shutdown(s.sock)
        return len(streams)

    def send_bookmarks(self) -> int:
        """Make every open watch that allows bookmarks send a BOOKMARK now. Returns how many."""
        with self._cond:
            streams = [s for s in self._streams if s.bookmarks]
            for s in streams:  # queued at the current rv: after the changes made so far, before later ones
                s.raw_lines.append((self._rv, _event_line("BOOKMARK", _bookmark(s.resource, self._rv))))
            self._cond.notify_all()
            return len(streams)

    def send_raw_watch_line(self, line: bytes, resource: str | None = None) -> int:
        """Write `line` (a newline is added) as one chunk into every open watch (of `resource`)."""
        with self._cond:
            streams = [s for s in self._streams if resource in (None, s.resource)]
            for s in streams:
                s.raw_lines.append((self._rv, line.rstrip(b"\n") + b"\n"))
            self._cond.notify_all()
            return len(streams)

    def open_watches(self, resource: str | None = None) -> int:
        with self._cond:
            return sum(1 for s in self._streams if resource in (None, s.resource) and not s.dropped)

    def wait_for_watches(self, n: int = 1, timeout: float = 5.0, resource: str | None = None) -> bool:
        """Block until at least n watch streams are open (event driven, no polling sleep in tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.open_watches(resource) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block until predicate() (evaluated under the fake's lock, re-checked on every change) is true."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_for_requests(self, predicate: Callable[[RecordedRequest], bool], n: int = 1,
                          timeout: float = 5.0) -> bool:
        """Block until at least n recorded requests satisfy predicate."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for r in self.requests if predicate(r)) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- store internals (call with or without the lock; RLock) ----------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, resource: str, event_type: str, obj: Obj, old: Obj | None) -> None:
        self._history.append(_Event(int(obj["metadata"]["resourceVersion"]), resource, event_type, obj, old))
        while len(self._history) > self.history_limit:
            self._trimmed_upto = self._history.popleft().rv
        self._cond.notify_all()

    def _normalise(self, resource: str, obj: Obj) -> Obj:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise ValueError("object needs a metadata dict")
        src = _copy(obj)
        meta_in = src.pop("metadata")
        name = meta_in.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("object needs metadata.name")
        meta: Obj = {"name": name}
        if resource == "pods":
            meta["namespace"] = meta_in.get("namespace") or "default"
        meta["uid"] = meta_in.get("uid") or str(uuid.uuid4())
        meta["resourceVersion"] = "0"
        if resource == "pods":
            meta["generation"] = meta_in.get("generation", 1)
        meta["creationTimestamp"] = meta_in.get("creationTimestamp") or _now()
        for k, v in meta_in.items():
            if k not in meta and k not in ("resourceVersion", "generation"):
                meta[k] = v
        out: Obj = {"kind": "Node" if resource == "nodes" else "Pod", "apiVersion": "v1", "metadata": meta}
        src.pop("kind", None)
        src.pop("apiVersion", None)
        out["spec"] = src.pop("spec", None) or ({} if resource == "nodes" else {"containers": []})
        status = src.pop("status", None) or {}
        if resource == "pods":
            status.setdefault("phase", "Pending")
        out["status"] = status
        out.update(src)
        return out

    def _create(self, resource: str, obj: Obj) -> Obj:
        new = self._normalise(resource, obj)
        key = _key(resource, new)
        with self._cond:
            if key in self._store[resource]:
                raise ApiError(status_failure(409, "AlreadyExists", f'{resource} "{new["metadata"]["name"]}" '
                                              "already exists",
                                              {"name": new["metadata"]["name"], "kind": resource}))
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[resource][key] = new
            self._record(resource, "ADDED", new, None)
        return new

    def _put(self, resource: str, key: str, new: Obj, old: Obj) -> Obj:
        new = _with_rv(new, self._next_rv())
        self._store[resource][key] = new
        self._record(resource, "MODIFIED", new, old)
        return new

    def _update(self, resource: str, key: str, change: Obj | Callable[[Obj], Obj | None]) -> Obj:
        with self._cond:
            old = self._store[resource].get(key)
            if old is None:
                raise KeyError(f"{resource} {key} not found")
            if callable(change):
                work = _copy(old)
                result = change(work)
                new = result if isinstance(result, dict) else work
            else:
                new = merge_patch(old, change)
            if new == old:
                return old
            return self._put(resource, key, new, old)

    def _delete(self, resource: str, key: str) -> Obj:
        with self._cond:
            old = self._store[resource].pop(key, None)
            if old is None:
                raise KeyError(f"{resource} {key} not found")
            gone = _with_rv(old, self._next_rv())
            self._record(resource, "DELETED", gone, old)
            return gone

    # -- request handling ------------------------------------------------------------------------------------

    def _take(self, items: list[Any], method: str, target: str) -> Any:
        for item in items:
            if item.remaining <= 0:
                continue
            if getattr(item, "method", None) and item.method != method:
                continue
            if item.pattern is not None and not item.pattern.search(target):
                continue
            item.remaining -= 1
            return item
        items[:] = [i for i in items if i.remaining > 0]
        return None

    def _serve(self, h: _Handler) -> None:
        split = urlsplit(h.path)
        path = unquote(split.path)
        query = dict(parse_qsl(split.query, keep_blank_values=True))
        body = h.read_body()
        with self._cond:
            self.requests.append(RecordedRequest(h.command, path, query))
            self._cond.notify_all()
            target = f"{path}?{split.query}" if split.query else path
            delay = self._take(self._delays, h.command, target)
            fault = self._take(self._faults, h.command, target)
        if delay is not None and delay.gate is not None:
            while not delay.gate.wait(0.05) and not self._stopping.is_set():
                pass
        elif delay is not None:
            self._stopping.wait(delay.seconds)
        try:
            if fault is not None:
                raise ApiError(fault_status(fault.status),
                               {"Retry-After": "1"} if fault.status == 429 else None)
            if self.token is not None:
                auth = h.headers.get("Authorization", "")
                if auth != f"Bearer {self.token}":
                    raise ApiError(status_failure(401, "Unauthorized", "Unauthorized"), {"_no_pf": "1"})
            self._route(h, h.command, path, query, body)
        except ApiError as err:
            h.send_json(int(err.status["code"]), err.status, err.headers)

    def _route(self, h: _Handler, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if parts == ["version"] and method == "GET":
            h.send_json(200, {"major": "1", "minor": "36", "gitVersion": "v1.36.2-fake", "platform": "linux/amd64"})
            return
        if len(parts) < 3 or parts[:2] != ["api", "v1"]:
            raise ApiError(_no_resource())
        rest = parts[2:]
        if rest[0] == "nodes":
            resource, namespace, rest = "nodes", None, rest[1:]
        elif rest[0] == "pods" and len(rest) == 1:
            resource, namespace, rest = "pods", None, []
        elif rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in ("pods", "bindings"):
            if rest[2] == "bindings" and len(rest) == 3:
                self._allow(method, "POST")
                self._bind(h, rest[1], None, body)
                return
            if rest[2] != "pods":
                raise ApiError(_no_resource())
            resource, namespace, rest = "pods", rest[1], rest[3:]
        else:
            raise ApiError(_no_resource())
        if not rest:
            if method == "GET":
                self._list_or_watch(h, resource, namespace, query)
            elif method == "POST" and (resource == "nodes" or namespace):
                self._create_http(h, resource, namespace, body)
            else:
                raise ApiError(_method_not_allowed())
            return
        name, sub = rest[0], rest[1:]
        key = name if resource == "nodes" else f"{namespace}/{name}"
        if not sub:
            if method == "GET":
                h.send_json(200, self._get(resource, key, name))
            elif method == "PATCH":
                self._patch(h, resource, key, name, None, body)
            elif method == "DELETE":
                self._delete_http(h, resource, key, name)
            else:
                raise ApiError(_method_not_allowed())
        elif sub == ["status"]:
            if method == "GET":
                h.send_json(200, self._get(resource, key, name))
            elif method == "PATCH":
                self._patch(h, resource, key, name, "status", body)
            else:
                raise ApiError(_method_not_allowed())
        elif sub == ["binding"] and resource == "pods":
            self._allow(method, "POST")
            self._bind(h, namespace or "", name, body)
        else:
            raise ApiError(_no_resource())

    @staticmethod
    def _allow(method: str, allowed: str) -> None:
        if method != allowed:
            raise ApiError(_method_not_allowed())

    def _get(self, resource: str, key: str, name: str) -> Obj:
        with self._cond:
            obj = self._store[resource].get(key)
        if obj is None:
            raise ApiError(not_found(resource, name))
        return obj

    def _create_http(self, h: _Handler, resource: str, namespace: str | None, body: bytes) -> None:
        obj = _decode(body)
        if not isinstance(obj, dict):
            raise ApiError(bad_request("the body of the request was in an unknown format"))
        meta = obj.setdefault("metadata", {})
        if namespace:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(bad_request("the namespace of the provided object does not match the namespace "
                                           "sent on the request"))
            meta["namespace"] = namespace
        try:
            new = self._create(resource, obj)
        except ValueError as exc:
            raise ApiError(invalid("Node" if resource == "nodes" else "Pod", str(meta.get("name", "")),
                                   [("FieldValueRequired", "metadata.name", f"Required value: {exc}")])) from exc
        h.send_json(201, new)

    def _delete_http(self, h: _Handler, resource: str, key: str, name: str) -> None:
        try:
            gone = self._delete(resource, key)
        except KeyError:
            raise ApiError(not_found(resource, name)) from None
        if resource == "pods":
            h.send_json(200, gone)
        else:
            h.send_json(200, status_success(200, {"name": name, "kind": resource,
                                                  "uid": gone["metadata"]["uid"]}))

    # -- list / watch ----------------------------------------------------------------------------------------

    def _selector(self, resource: str, namespace: str | None, query: dict[str, str]) -> Selector:
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""), resource)
        return Selector(namespace, tuple(labels), tuple(fields))

    def _list_or_watch(self, h: _Handler, resource: str, namespace: str | None, query: dict[str, str]) -> None:
        selector = self._selector(resource, namespace, query)
        if query.get("watch") in ("1", "true", "True"):
            self._watch(h, resource, selector, query)
        else:
            h.send_json(200, self._list(resource, selector, query))

    def _list(self, resource: str, selector: Selector, query: dict[str, str]) -> Obj:
        limit_raw = query.get("limit", "")
        try:
            limit = int(limit_raw) if limit_raw else 0
        except ValueError:
            raise ApiError(bad_request(f"invalid limit: {limit_raw!r}")) from None
        token = query.get("continue", "")
        kind = "NodeList" if resource == "nodes" else "PodList"
        with self._cond:
            exact_rv = query.get("resourceVersion", "") if query.get("resourceVersionMatch") == "Exact" else ""
            if exact_rv.isdigit() and int(exact_rv) < max(self._compacted_upto, self._trimmed_upto):
                raise ApiError(status_failure(410, "Expired", "The resourceVersion for the provided list is too old."))
            if token:
                snap_rv, start = _decode_continue(token)
                if snap_rv == -1:
                    rows = sorted(self._store[resource].items())
                    list_rv = self._rv
                else:
                    snap = self._snapshots.get((resource, snap_rv))
                    if snap is None or snap_rv < self._compacted_upto:
                        raise ApiError(_continue_expired(start))
                    rows, list_rv = snap, snap_rv
                rows = [r for r in rows if r[0] > start]
            else:
                rows = sorted(self._store[resource].items())
                list_rv = self._rv
            items: list[Obj] = []
            last_key = ""
            consumed = 0
            for k, obj in rows:
                consumed += 1
                if selector.matches(obj):
                    items.append(_list_item(obj))
                    last_key = k
                    if limit and len(items) >= limit:
                        break
            remaining_rows = rows[consumed:]
            more = bool(limit) and any(selector.matches(o) for _, o in remaining_rows)
            meta: Obj = {"resourceVersion": str(list_rv)}
            if more:
                if list_rv == self._rv and not token:
                    self._snapshots[(resource, list_rv)] = rows
                    while len(self._snapshots) > 16:
                        self._snapshots.pop(next(iter(self._snapshots)))
                meta["continue"] = _encode_continue(list_rv, last_key)
                if not selector.filtered:
                    meta["remainingItemCount"] = len(remaining_rows)
        return {"kind": kind, "apiVersion": "v1", "metadata": meta, "items": items}

    def _watch(self, h: _Handler, resource: str, selector: Selector, query: dict[str, str]) -> None:
        rv_raw = query.get("resourceVersion", "")
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true", "True")
        timeout_raw = query.get("timeoutSeconds", "")
        try:
            timeout = int(timeout_raw) if timeout_raw else None
        except ValueError:
            raise ApiError(bad_request(f"invalid timeoutSeconds: {timeout_raw!r}")) from None
        if rv_raw not in ("", "0") and not rv_raw.isdigit():
            raise ApiError(bad_request(f"invalid resource version: {rv_raw}"))
        deadline = time.monotonic() + timeout if timeout else None
        initial: list[bytes] = []
        expired_line: bytes | None = None
        with self._cond:
            if rv_raw in ("", "0"):
                for _, obj in sorted(self._store[resource].items()):
                    if selector.matches(obj):
                        initial.append(_event_line("ADDED", obj))
                cursor = self._rv
                if bookmarks:
                    initial.append(_event_line("BOOKMARK", _bookmark(resource, cursor, initial_end=True)))
            else:
                cursor = int(rv_raw)
                if cursor < max(self._compacted_upto, self._trimmed_upto):
                    expired_line = _event_line("ERROR", _expired(cursor, self._rv))
            if expired_line is None:
                stream = _Stream(resource, selector, bookmarks, h.connection)
                self._streams.append(stream)
                self._cond.notify_all()
        if expired_line is not None:  # like the apiserver: HTTP 200, one ERROR event, end of stream
            h.start_stream()
            h.write_chunk(expired_line)
            h.end_stream()
            return
        try:
            h.start_stream()
            for line in initial:
                h.write_chunk(line)
            while True:
                with self._cond:
                    while True:
                        if self._stopping.is_set() or stream.dropped:
                            h.close_connection = True
                            return
                        if (self._rv > cursor or stream.raw_lines
                                or (deadline is not None and time.monotonic() >= deadline)):
                            break
                        if _peer_closed(h.connection):  # the client went away: end like the apiserver does
                            h.close_connection = True
                            return
                        wait = 0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))
                        self._cond.wait(wait)
                    lines: list[bytes] = []
                    if cursor < self._trimmed_upto:
                        lines.append(_event_line("ERROR", _expired(cursor, self._rv)))
                        expired = True
                    else:
                        expired = False
                        # injected lines keep their place among the changes made before and after them
                        ordered = [((rv, 0), line) for rv, line in self._events_after(resource, selector, cursor)]
                        ordered += [((rv, 1), line) for rv, line in stream.raw_lines]
                        lines.extend(line for _, line in sorted(ordered, key=lambda x: x[0]))
                        cursor = self._rv
                    stream.raw_lines.clear()
                    timed_out = deadline is not None and time.monotonic() >= deadline
                    if bookmarks and not expired and timed_out:  # the apiserver's bookmark before it ends a watch
                        lines.append(_event_line("BOOKMARK", _bookmark(resource, cursor)))
                for line in lines:
                    h.write_chunk(line)
                if expired or timed_out:
                    h.end_stream()
                    return
        except OSError:
            h.close_connection = True
        finally:
            with self._cond:
                if stream in self._streams:
                    self._streams.remove(stream)
                self._cond.notify_all()

    def _events_after(self, resource: str, selector: Selector, cursor: int) -> list[tuple[int, bytes]]:
        pending: list[_Event] = []
        for ev in reversed(self._history):
            if ev.rv <= cursor:
                break
            if ev.resource == resource:
                pending.append(ev)
        out: list[tuple[int, bytes]] = []
        for ev in reversed(pending):
            now = selector.matches(ev.obj)
            if ev.type == "ADDED":
                if now:
                    out.append((ev.rv, _event_line("ADDED", ev.obj)))
            elif ev.type == "DELETED":
                if now:
                    out.append((ev.rv, _event_line("DELETED", ev.obj)))
            else:
                before = selector.matches(ev.old)
                if before and now:
                    out.append((ev.rv, _event_line("MODIFIED", ev.obj)))
                elif now:
                    out.append((ev.rv, _event_line("ADDED", ev.obj)))
                elif before and ev.old is not None:
                    out.append((ev.rv, _event_line("DELETED", _with_rv(ev.old, ev.rv))))
        return out

    # -- patch -----------------------------------------------------------------------------------------------

    def _patch(self, h: _Handler, resource: str, key: str, name: str, sub: str | None, body: bytes) -> None:
        ctype = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype not in PATCH_TYPES:
            raise ApiError(status_failure(415, "UnsupportedMediaType", "415: Unsupported Media Type", {}))
        try:
            patch = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            truncated = "unexpected end" in str(exc) or "zero-length" in str(exc)
            msg = "unexpected end of JSON input" if truncated else str(exc)
            raise ApiError(bad_request(f"error decoding patch: {msg}")) from None
        kind = "Node" if resource == "nodes" else "Pod"
        with self._cond:
            old = self._store[resource].get(key)
            if old is None:
                raise ApiError(not_found(resource, name))
            if ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise ApiError(bad_request(
                        f"json: cannot unmarshal {type(patch).__name__} into Go value of type jsonpatch.Patch"))
                try:
                    new = json_patch(old, patch)
                except ValueError as exc:
                    raise ApiError(unprocessable(str(exc))) from None
            else:
                if not isinstance(patch, dict) or not _shape_ok(patch):
                    raise ApiError(status_failure(
                        422, "Invalid",
                        f' "" is invalid: patch: Invalid value: "{_go_repr(patch)}": cannot restore map from '
                        f"{_go_type(patch)}",
                        {"causes": [{"reason": "FieldValueInvalid",
                                     "message": f'Invalid value: "{_go_repr(patch)}": cannot restore map',
                                     "field": "patch"}]}))
                pmeta = patch.get("metadata") if isinstance(patch.get("metadata"), dict) else {}
                want_rv = pmeta.get("resourceVersion")
                if want_rv is not None and want_rv != old["metadata"]["resourceVersion"]:
                    raise ApiError(conflict(resource, name, "the object has been modified; please apply your "
                                            "changes to the latest version and try again"))
                want_uid = pmeta.get("uid")
                if want_uid is not None and want_uid != old["metadata"]["uid"]:
                    raise ApiError(conflict(resource, name, f"Precondition failed: UID in precondition: "
                                            f"{want_uid}, UID in object meta: {old['metadata']['uid']}"))
                new = merge_patch(old, patch)
            new = self._settle(resource, kind, name, old, new, sub)
            if new == old:
                result = old
            else:
                result = self._put(resource, key, new, old)
        h.send_json(200, result)

    def _settle(self, resource: str, kind: str, name: str, old: Obj, new: Obj, sub: str | None) -> Obj:
        """Keep server-owned fields, apply subresource rules, validate: like the apiserver's update strategy."""
        if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
            raise ApiError(invalid(kind, name, [("FieldValueRequired", "metadata", "Required value")]))
        if new["metadata"].get("name") != name:
            raise ApiError(bad_request(f"the name of the object ({new['metadata'].get('name')}) does not match "
                                       f"the name on the URL ({name})"))
        if sub == "status":
            settled = dict(old)
            settled["status"] = new.get("status") or {}
        else:
            settled = dict(new)
            settled["status"] = old.get("status", {})
            meta = dict(new["metadata"])
            for fixed in ("uid", "resourceVersion", "creationTimestamp", "namespace", "generation"):
                if fixed in old["metadata"]:
                    meta[fixed] = old["metadata"][fixed]
            settled["metadata"] = meta
            settled["kind"], settled["apiVersion"] = old["kind"], old["apiVersion"]
        causes = validate_metadata(kind, settled)
        if causes:
            raise ApiError(invalid(kind, name, causes))
        if resource == "pods" and sub is None:
            old_spec = {k: v for k, v in (old.get("spec") or {}).items() if k not in _POD_MUTABLE_SPEC}
            new_spec = {k: v for k, v in (settled.get("spec") or {}).items() if k not in _POD_MUTABLE_SPEC}
            if old_spec != new_spec:
                msg = ("Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                       "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                       "additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be "
                       "set to 1 if it was previously negative)")
                raise ApiError(invalid(kind, name, [("FieldValueForbidden", "spec", msg)]))
        return settled

    # -- binding ---------------------------------------------------------------------------------------------

    def _bind(self, h: _Handler, namespace: str, name: str | None, body: bytes) -> None:
        binding = _decode(body)
        if not isinstance(binding, dict):
            raise ApiError(bad_request("the body of the request was in an unknown format"))
        meta = binding.get("metadata") if isinstance(binding.get("metadata"), dict) else {}
        if name is None:  # POST .../bindings: the pod is named in the Binding
            name = meta.get("name") or ""
        elif meta.get("name") != name:
            raise ApiError(bad_request("name in URL does not match name in Binding object"))
        target = binding.get("target") if isinstance(binding.get("target"), dict) else {}
        if target.get("kind") not in (None, "", "Node"):
            raise ApiError(invalid("Binding", name, [("FieldValueNotSupported", "target.kind",
                                                      f'Unsupported value: "{target.get("kind")}": supported '
                                                      'values: "Node", ""')]))
        node = target.get("name")
        if not isinstance(node, str) or not node:
            raise ApiError(invalid("Binding", name, [("FieldValueRequired", "target.name", "Required value")]))
        annotations = meta.get("annotations") or {}
        if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
            raise ApiError(invalid("Binding", name, [("FieldValueInvalid", "metadata.annotations",
                                                      "Invalid value: must be a map of strings")]))
        key = f"{namespace}/{name}"
        with self._cond:
            pod = self._store["pods"].get(key)
            if pod is None:
                raise ApiError(not_found("pods", name))
            pmeta = pod["metadata"]
            if meta.get("uid") and meta["uid"] != pmeta["uid"]:
                raise ApiError(conflict("pods/binding", name, f"Precondition failed: UID in precondition: "
                                        f"{meta['uid']}, UID in object meta: {pmeta['uid']}"))
            if meta.get("resourceVersion") and meta["resourceVersion"] != pmeta["resourceVersion"]:
                raise ApiError(conflict("pods/binding", name, "the object has been modified; please apply your "
                                        "changes to the latest version and try again"))
            if pmeta.get("deletionTimestamp"):
                raise ApiError(conflict("pods/binding", name,
                                        f"pod {name} is being deleted, cannot be assigned to a host"))
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                raise ApiError(conflict("pods/binding", name,
                                        f'pod {name} is already assigned to node "{bound}"'))
            if (pod.get("spec") or {}).get("schedulingGates"):
                raise ApiError(conflict("pods/binding", name, f"pod {name} has non-empty .spec.schedulingGates"))
            new = _copy(pod)
            new["spec"]["nodeName"] = node
            if annotations:
                new["metadata"].setdefault("annotations", {}).update(annotations)
            conditions = [c for c in new["status"].get("conditions", []) if c.get("type") != "PodScheduled"]
            conditions.insert(0, {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                                  "lastTransitionTime": _now()})
            new["status"]["conditions"] = conditions
            self._put("pods", key, new, pod)
        h.send_json(201, status_success(201))


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _decode(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(bad_request(f"couldn't get version/kind; json parse error: {exc}")) from None


def _shape_ok(patch: Obj) -> bool:
    meta = patch.get("metadata")
    if meta is None:
        return True
    if not isinstance(meta, dict):
        return False
    return all(meta.get(f) is None or isinstance(meta.get(f), dict) for f in ("labels", "annotations"))


def _go_type(value: Any) -> str:
    meta = value.get("metadata") if isinstance(value, dict) else None
    bad = meta if not isinstance(meta, dict) else next(
        (meta[f] for f in ("labels", "annotations") if meta.get(f) is not None and not isinstance(meta[f], dict)),
        value)
    return {str: "string", int: "int64", float: "float64", bool: "bool", list: "slice"}.get(type(bad), "value")


def _go_repr(value: Any) -> str:
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{_go_repr(v)}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, list):
        return "[" + " ".join(_go_repr(v) for v in value) + "]"
    return "<nil>" if value is None else str(value)


def _no_resource() -> Obj:
    return status_failure(404, "NotFound", "the server could not find the requested resource", {})


def _method_not_allowed() -> Obj:
    return status_failure(405, "MethodNotAllowed",
                          "the server does not allow this method on the requested resource", {})


def _expired(rv: int, current: int) -> Obj:
    return status_failure(410, "Expired", f"too old resource version: {rv} ({current})")


def _encode_continue(rv: int, start: str) -> str:
    raw = orjson.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start + "\u0000"})
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        data = orjson.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        rv, start = data["rv"], data["start"]
        if data.get("v") != "meta.k8s.io/v1" or not isinstance(rv, int) or not isinstance(start, str):
            raise ValueError("bad fields")
    except (ValueError, KeyError, TypeError, binascii.Error, orjson.JSONDecodeError):
        raise ApiError(bad_request(f"continue key is not valid: {token}")) from None
    return rv, start.rstrip("\u0000")


def _continue_expired(start: str) -> Obj:
    return status_failure(
        410, "Expired",
        "The provided continue parameter is too old to display a consistent list result. You can start a new "
        "list without the continue parameter, or use the continue token in this response to retrieve the "
        "remainder of the results. Continuing with the provided token results in an inconsistent list - objects "
        "that were created, modified, or deleted between the time the first chunk was returned and now may show "
        "up in the list.",
        metadata={"continue": _encode_continue(-1, start)},
    )


def _bookmark(resource: str, rv: int, *, initial_end: bool = False) -> Obj:
    meta: Obj = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    if resource == "nodes":
        return {"kind": "Node", "apiVersion": "v1", "metadata": meta, "spec": {}, "status": NODE_BOOKMARK_STATUS}
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": None}, "status": {}}


def _event_line(event_type: str, obj: Obj) -> bytes:
    return orjson.dumps({"type": event_type, "object": obj}) + b"\n"


def _peer_closed(sock: socket.socket) -> bool:
    """True when the client closed its end (a watch client sends nothing, so readable means EOF or error)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler], fake: FakeKubeApi) -> None:
        self.fake = fake
        self._conns: set[socket.socket] = set()
        self._conn_threads: set[threading.Thread] = set()
        self._conn_lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # headers and body go out in separate writes: without NODELAY each reply waits for a delayed ACK (~40 ms)
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._serve_conn, args=(request, client_address),
                                  name="fake-kubeapi-conn", daemon=True)
        with self._conn_lock:
            self._conns.add(request)
            self._conn_threads.add(thread)
        thread.start()

    def _serve_conn(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)
            with self._conn_lock:
                self._conns.discard(request)
                self._conn_threads.discard(threading.current_thread())

    def close_all(self) -> None:
        with self._conn_lock:
            conns = list(self._conns)
            threads = list(self._conn_threads)
        for conn in conns:
            _shutdown(conn)
        for thread in threads:
            thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 120

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        self.server.fake._serve(self)

    do_POST = do_PATCH = do_DELETE = do_PUT = do_GET

    def read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length:
            return self.rfile.read(int(length))
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return b""

    def _head(self, status: int, extra: dict[str, str] | None = None) -> None:
        extra = dict(extra or {})
        pf = extra.pop("_no_pf", None) is None
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        self.send_response_only(status, phrase)
        self.send_header("Audit-Id", str(uuid.uuid4()))
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Content-Type", "application/json")
        if pf:
            self.send_header("X-Kubernetes-Pf-Flowschema-Uid", FLOWSCHEMA_UID)
            self.send_header("X-Kubernetes-Pf-Prioritylevel-Uid", PRIORITYLEVEL_UID)
        self.send_header("Date", email.utils.formatdate(usegmt=True))
        for name, value in extra.items():
            self.send_header(name, value)

    def send_json(self, status: int, obj: Obj, extra: dict[str, str] | None = None) -> None:
        data = orjson.dumps(obj) + b"\n"
        self._head(status, extra)
        if len(data) <= MAX_CONTENT_LENGTH_BODY:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 1 << 16):
                self.write_chunk(data[i:i + (1 << 16)])
            self.wfile.write(b"0\r\n\r\n")

    def start_stream(self) -> None:
        if getattr(self, "_streaming", False):
            return
        self._streaming = True
        self._head(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self._streaming = False
