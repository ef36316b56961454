"""FakeKubeApi: the core/v1 fake served over HTTP, with its lifecycle, the log of requests (for RBAC proofs), bearer
token checks, and the request faults tests inject (fail_next, delay_next, hold_next)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

from tests.fakes.kubeapi.core import CoreV1
from tests.fakes.kubeapi.status import ApiError, fault_status, status_failure
from tests.fakes.kubeapi.transport import Handler, Server


class RecordedRequest(NamedTuple):
    """One request the fake received: query is the decoded query string (last value wins)."""

    method: str
    path: str
    query: dict[str, str]


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


class FakeKubeApi(CoreV1):
    """The fake apiserver. Use as a context manager; `url` is http://127.0.0.1:<port>."""

    def __init__(self, *, token: str | None = None, history_limit: int = 10_000, first_rv: int = 100) -> None:
        super().__init__(history_limit=history_limit, first_rv=first_rv)
        self.token = token
        self.requests: list[RecordedRequest] = []
        self._faults: list[_Fault] = []
        self._delays: list[_Delay] = []
        self._server: Server | None = None
        self._serve_thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        if self._server is not None:
            raise RuntimeError("FakeKubeApi already started")
        self._stopping.clear()
        self._server = Server(("127.0.0.1", 0), Handler, self)
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

    # -- requests and their faults ---------------------------------------------------------------------------

    def clear_requests(self) -> None:
        with self._cond:
            self.requests.clear()

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

    def _serve(self, h: Handler) -> None:
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
