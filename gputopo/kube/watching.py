"""List+watch of Nodes, Pods or the objects of an API group in a background thread, delivering plain-dict events to
a callback.

The callback first gets ("SYNC", <list object>) — a full snapshot to replace any cache with — then
("ADDED"|"MODIFIED"|"DELETED", <object>) for each change. After a 410 (history compacted) the watcher re-lists and
delivers a new SYNC; after connection errors and 5xx it reconnects from the last resourceVersion with a capped,
jittered exponential backoff. A resource that may not exist (a CRD not installed, an alpha API
switched off, or one RBAC does not grant) is watched with `absent_retry_s`: a 404 or 403 then counts as "absent",
logged once, delivered as an empty SYNC, and looked for again after that many seconds, not retried as an error.
Watch lines are decoded one by one with orjson straight from the raw urllib3
response, so a 5,000-node cluster costs no model-class parsing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import orjson
import structlog
from prometheus_client import CollectorRegistry, Counter

from gputopo.kube.client import call_raw, request_timeout
from gputopo.kube.errors import (
    Forbidden,
    Gone,
    KubeApiError,
    KubeArgumentError,
    NotFound,
    error_from_status,
    to_kube_error,
)
from gputopo.kube.fetching import KINDS, ApiResource, list_method, list_objects
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

WatchCallback = Callable[[str, dict[str, Any]], None]

SYNC = "SYNC"
CHANGE_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED"})
_LIST_KIND = {"nodes": "NodeList", "pods": "PodList", "resourceslices": "ResourceSliceList"}
_READ_SIZE = 1 << 16


class WatchMetrics:
    """Watch counters on the process's registry, named with the process's metric prefix (one per binary)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.events = Counter(
            f"{prefix}_kube_watch_events_total",
            "Watch events received from the apiserver, by watched kind and event type.",
            ["kind", "type"],
            registry=registry,
        )
        self.restarts = Counter(
            f"{prefix}_kube_watch_restarts_total",
            "Watch restarts, by kind and reason (relist after 410, error backoff).",
            ["kind", "reason"],
            registry=registry,
        )


@dataclass
class WatchStats:
    """Counters of what one Watcher did; for logs, tests and debugging."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    relists: int = 0
    absent: int = 0
    errors: int = 0
    skipped_lines: int = 0
    callback_errors: int = 0


def iter_lines(resp: Any) -> Iterator[bytes]:
    """Non-empty lines of a streamed urllib3 response, as they arrive (chunked or not)."""
    if getattr(resp, "chunked", False):
        chunks: Iterator[bytes] = resp.stream(_READ_SIZE, decode_content=True)
    else:
        chunks = iter(lambda: resp.read1(_READ_SIZE), b"")
    pending: list[bytes] = []
    for chunk in chunks:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            if pending:
                pending.append(chunk[start:nl])
                line = b"".join(pending)
                pending.clear()
            else:
                line = chunk[start:nl]
            if line.strip():
                yield line
            start = nl + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    tail = b"".join(pending)
    if tail.strip():
        yield tail


class Watcher(Worker):
    """Keeps a callback up to date with all `kind` objects matching the selectors, until stop()."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        kind: str | ApiResource,
        on_event: WatchCallback,
        *,
        namespace: str | None = None,
        field_selector: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
        page_limit: int | None = 500,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        deliver_bookmarks: bool = False,
        name: str | None = None,
        metrics: WatchMetrics | None = None,
        absent_retry_s: float | None = None,
    ) -> None:
        if not isinstance(kind, ApiResource) and kind not in KINDS:
            raise KubeArgumentError(f"kind must be one of {KINDS} or an ApiResource, got {kind!r}")
        if absent_retry_s is not None and not absent_retry_s > 0:
            raise KubeArgumentError(f"absent_retry_s must be positive, got {absent_retry_s!r}")
        if not isinstance(timeout_seconds, int) or timeout_seconds <= 0:
            raise KubeArgumentError(f"timeout_seconds must be a positive int, got {timeout_seconds!r}")
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise KubeArgumentError("need 0 < backoff_initial_s <= backoff_max_s")
        list_method(api, kind, namespace)  # validates kind/namespace now rather than in the thread
        self.api = api
        self.kind = kind
        self.namespace = namespace
        self.field_selector = field_selector
        self.label_selector = label_selector
        self.timeout_seconds = timeout_seconds
        self.page_limit = page_limit
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.deliver_bookmarks = deliver_bookmarks
        self.absent_retry_s = absent_retry_s
        self.label = str(kind)  # metrics and logs: "pods", "podgroups.scheduling.x-k8s.io"
        self._list_kind = f"{kind.kind}List" if isinstance(kind, ApiResource) else _LIST_KIND[kind]
        self._absent_why: str | None = None
        super().__init__(name or f"watch-{self.label}" + (f"-{namespace}" if namespace else ""))
        self.stats = WatchStats()
        self._metrics = metrics
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._on_event = on_event
        self._synced = threading.Event()
        self._resp_lock = threading.Lock()
        self._resp: Any = None
        self._rv: str | None = None
        self._relist = False
        self._progress = threading.Condition()
        self._log = log.bind(
            watcher=self.name,
            kind=self.label,
            namespace=namespace,
            field_selector=field_selector,
            label_selector=label_selector,
        )

    # -- public ----------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> str | None:
        """The newest resourceVersion delivered (list, event) or announced by a bookmark; None before the first
        list."""
        return self._rv

    def wait_delivered(self, rv: str, timeout: float) -> bool:
        """Block until every change up to resourceVersion `rv` has been delivered (True), or `timeout` passed
        (False). resourceVersions are compared as the integers the apiserver's etcd storage makes them; one that
        is not raises KubeArgumentError (the caller must then relist instead)."""
        target = _rv_number(rv)
        deadline = time.monotonic() + timeout
        with self._progress:
            while True:
                if self._rv is not None and _rv_number(self._rv) >= target:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping:
                    return False
                self._progress.wait(left)

    def relist(self, timeout: float) -> bool:
        """List again now (a fresh SYNC, as after an expired resourceVersion) and block until it was delivered
        (True) or `timeout` passed (False)."""
        with self._progress:
            lists = self.stats.lists
            self._relist = True
        self.interrupt()
        deadline = time.monotonic() + timeout
        with self._progress:
            while self.stats.lists == lists or self._relist:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping:
                    return False
                self._progress.wait(left)
        return True

    def _advanced(self, rv: str | None) -> None:
        with self._progress:
            self._rv = rv
            self._progress.notify_all()

    @property
    def absent(self) -> str | None:
        """Why the resource is absent now (absent_retry_s set and the last list got 404 or 403), else None."""
        return self._absent_why

    @property
    def synced(self) -> bool:
        """True once the first SYNC snapshot was delivered."""
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Block until the first snapshot was delivered; False on timeout."""
        return self._synced.wait(timeout)

    # -- thread ----------------------------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Close an open watch stream, so stop() does not wait for the server's next line."""
        with self._resp_lock:
            resp = self._resp
        if resp is None:
            return
        try:
            resp.shutdown()
        except Exception:
            try:
                resp.close()
            except Exception as exc:  # nothing more we can do; the read times out eventually
                self._log.debug("kube.watch.interrupt_failed", error=str(exc))

    def _deliver(self, event_type: str, obj: dict[str, Any]) -> None:
        try:
            self._on_event(event_type, obj)
        except Exception:
            self.stats.callback_errors += 1
            self._log.exception("kube.watch.callback_failed", event_type=event_type)

    def _restarted(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.restarts.labels(self.label, reason).inc()

    def loop(self) -> None:
        attempt = 0
        need_list = True
        self._log.info("kube.watch.start")
        while not self.stopping:
            try:
                if need_list or self._relist:
                    self._relist = False
                    self._list_and_sync()
                    need_list = False
                if self._watch_once():
                    attempt = 0
            except (NotFound, Forbidden) as exc:
                if self.stopping:
                    break
                if self.absent_retry_s is None:
                    attempt += 1
                    self._note_error(exc.status, exc.reason, exc.message, attempt)
                    self._sleep_backoff(attempt)
                    continue
                self._went_absent(exc)
                need_list, attempt = True, 0
                self.pause(self.absent_retry_s)
            except Gone as exc:
                self.stats.relists += 1
                self._restarted("expired")
                self._log.info("kube.watch.relist", reason=exc.reason, message=exc.message, rv=self._rv)
                need_list = True
                attempt += 1
                if attempt > 1:  # a fresh list's resourceVersion expiring again: do not spin
                    self._sleep_backoff(attempt - 1)
            except KubeApiError as exc:
                if self.stopping:
                    break
                attempt += 1
                self._note_error(exc.status, exc.reason, exc.message, attempt)
                self._sleep_backoff(attempt)
            except Exception as exc:
                if self.stopping:
                    break
                attempt += 1
                self.stats.errors += 1
                self._restarted("unexpected")
                self._log.exception("kube.watch.unexpected_error", error=repr(exc), attempt=attempt)
                self._sleep_backoff(attempt)
        self._log.info("kube.watch.stopped", rv=self._rv, **self.stats.__dict__)

    def _note_error(self, status: int, reason: str, message: str, attempt: int) -> None:
        self.stats.errors += 1
        self._restarted("error")
        self._log.warning(
            "kube.watch.error", status=status, reason=reason, message=message, attempt=attempt, rv=self._rv
        )

    def _sleep_backoff(self, attempt: int) -> None:
        self.pause(self._backoff.delay(attempt))

    def _went_absent(self, exc: KubeApiError) -> None:
        """The resource is not served (404) or not ours to read (403): forget its objects and say so once."""
        why = "not installed" if isinstance(exc, NotFound) else "forbidden"
        self.stats.absent += 1
        self._restarted("absent")
        if self._absent_why != why:
            self._log.info("kube.watch.absent", why=why, status=exc.status, message=exc.message,
                           retry_s=self.absent_retry_s)
        self._absent_why = why
        self._rv = None
        if not self.stopping:
            self._deliver(SYNC, {"kind": self._list_kind, "apiVersion": "v1", "metadata": {"resourceVersion": ""},
                                 "items": []})
        self._synced.set()

    def _list_and_sync(self) -> None:
        items, rv = list_objects(
            self.api,
            self.kind,
            namespace=self.namespace,
            field_selector=self.field_selector,
            label_selector=self.label_selector,
            limit=self.page_limit,
        )
        if self._absent_why is not None:
            self._log.info("kube.watch.present", was=self._absent_why)
            self._absent_why = None
        snapshot = {
            "kind": self._list_kind,
            "apiVersion": "v1",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }
        self._log.info("kube.watch.synced", items=len(items), rv=rv)
        if not self.stopping:
            self._deliver(SYNC, snapshot)
        with self._progress:
            self.stats.lists += 1
        self._advanced(rv or None)
        self._synced.set()

    def _watch_once(self) -> bool:
        """One watch request until the server ends it. True when it was healthy (resets the backoff)."""
        method = list_method(self.api, self.kind, self.namespace)
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": self.timeout_seconds,
            "_request_timeout": (request_timeout(self.api), float(self.timeout_seconds) + 30.0),
        }
        if self._rv:
            kwargs["resource_version"] = self._rv
        if self.field_selector:
            kwargs["field_selector"] = self.field_selector
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        operation = f"watch {self.label}"
        resp = call_raw(operation, method, **kwargs)
        with self._resp_lock:
            self._resp = resp
        self.stats.watches += 1
        healthy = completed = False
        try:
            if self.stopping or self._relist:  # asked while the request was being made: interrupt() found no stream
                return False
            for line in iter_lines(resp):
                if self.stopping or self._relist:
                    return False
                self._handle_line(line, operation)
                healthy = True
            completed = True
            return True
        except KubeApiError:
            raise
        except Exception as exc:
            if self.stopping or self._relist:
                return False
            err = to_kube_error(exc, operation=operation)
            if err is None:
                raise
            if healthy:  # a stream that worked and then broke: reconnect after the first backoff step only
                self._note_error(err.status, err.reason, err.message, 1)
                self._sleep_backoff(1)
                return True
            raise err from exc
        finally:
            with self._resp_lock:
                self._resp = None
            try:
                if not completed:  # a half-read stream cannot go back to the pool
                    resp.close()
                resp.release_conn()
            except Exception as exc:
                self._log.debug("kube.watch.close_failed", error=str(exc))

    def _handle_line(self, line: bytes, operation: str) -> None:
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            self._skip(line, f"not JSON: {exc}")
            return
        if not isinstance(event, dict):
            self._skip(line, "not a JSON object")
            return
        event_type = event.get("type")
        obj = event.get("object")
        if not isinstance(event_type, str) or not isinstance(obj, dict):
            self._skip(line, "missing type or object")
            return
        if self._metrics is not None:
            self._metrics.events.labels(self.label, event_type if event_type in _KNOWN_TYPES else "other").inc()
        if event_type == "ERROR":
            raise error_from_status(obj, operation=operation)
        meta = obj.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if event_type == "BOOKMARK":
            self.stats.bookmarks += 1
            if isinstance(rv, str) and rv:
                self._advanced(rv)
            if self.deliver_bookmarks:
                self._deliver(event_type, obj)
            return
        if event_type not in CHANGE_TYPES:
            self._skip(line, f"unknown event type {event_type!r}")
            return
        self.stats.events += 1
        self._deliver(event_type, obj)
        if isinstance(rv, str) and rv:
            self._advanced(rv)  # after the delivery: wait_delivered promises the change is in the caller's view

    def _skip(self, line: bytes, why: str) -> None:
        self.stats.skipped_lines += 1
        self._log.warning("kube.watch.bad_line", why=why, line=line[:200].decode("utf-8", "replace"))


_KNOWN_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})


def _rv_number(rv: str) -> int:
    try:
        return int(rv)
    except (TypeError, ValueError):
        raise KubeArgumentError(f"resourceVersion {rv!r} is not a number: cannot tell which is newer") from None
