"""List and watch for every resource: paging with continue tokens, watch streams replaying the store's history,
bookmarks, 410 Expired (inside a watch, for an old continue token), and the faults tests inject into watches."""

from __future__ import annotations

import base64
import binascii
import select
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from tests.fakes.kubeapi.objects import Obj, with_rv
from tests.fakes.kubeapi.selectors import Selector, parse_field_selector, parse_label_selector
from tests.fakes.kubeapi.status import ApiError, bad_request, status_failure
from tests.fakes.kubeapi.store import Event, Store
from tests.fakes.kubeapi.transport import shutdown_socket

if TYPE_CHECKING:
    from tests.fakes.kubeapi.transport import Handler

NODE_BOOKMARK_STATUS: Obj = {
    "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
    "nodeInfo": {
        "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "", "osImage": "",
        "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "", "operatingSystem": "",
        "architecture": "",
    },
}


@dataclass
class _Stream:
    resource: str
    selector: Selector
    bookmarks: bool
    sock: socket.socket
    raw_lines: list[tuple[int, bytes]] = field(default_factory=list)  # (rv when injected, line)
    dropped: bool = False


class ListWatch(Store):
    """The store's list and watch verbs (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._snapshots: dict[tuple[str, int], list[tuple[str, Obj]]] = {}
        self._streams: list[_Stream] = []

    # -- watch faults ----------------------------------------------------------------------------------------

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
            shutdown_socket(s.sock)
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

    # -- list / watch ----------------------------------------------------------------------------------------

    def _selector(self, resource: str, namespace: str | None, query: dict[str, str]) -> Selector:
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""), resource)
        return Selector(namespace, tuple(labels), tuple(fields))

    def _list_or_watch(self, h: Handler, resource: str, namespace: str | None, query: dict[str, str]) -> None:
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

    def _watch(self, h: Handler, resource: str, selector: Selector, query: dict[str, str]) -> None:
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
        pending: list[Event] = []
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
                    out.append((ev.rv, _event_line("DELETED", with_rv(ev.old, ev.rv))))
        return out


def _list_item(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


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
