"""A listener's lane (extender.http.server): requests it claims are answered in the protocol, past the app, and
everything else about the connection stays as uvicorn and the guard make it. A real server on 127.0.0.1 and raw
sockets, so pipelining, split and large bodies, 100-continue, keep-alive and deadlines are what a client sees."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from extender.http.bodies import BodyTooLarge, read_body
from extender.http.server import ConnectionLimits, server_config
from tests.helpers.polling import eventually

LIMIT = 200_000  # bytes of body
BODY_TIMEOUT_S = 1.0


class Metrics:
    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.http_connections = Gauge("lane_http_connections", "", ["listener"], registry=registry)
        self.http_connections_closed = Counter("lane_http_connections_closed", "", ["listener", "reason"],
                                               registry=registry)


class EchoLane:
    """Claims POST /lane; answers the body's length, declines a body that starts with "decline", raises on one
    that starts with "raise"; records what its follow-ups saw."""

    def __init__(self) -> None:
        self.answered: list[int] = []
        self.follow_ups: list[int] = []

    def claims(self, scope: dict[str, Any]) -> bool:
        return scope["method"] == "POST" and scope["path"] == "/lane"

    def __call__(self, scope: dict[str, Any], body: bytes) -> tuple[int, bytes, Any] | None:
        if body.startswith(b"decline"):
            scope["declined"] = True
            return None
        if body.startswith(b"raise"):
            raise RuntimeError("lane broke")
        if body.startswith(b"later"):
            return self._later(body)
        self.answered.append(len(body))
        n = len(self.answered)
        return 200, orjson.dumps({"lane": len(body)}), lambda: self.follow_ups.append(n)

    async def _later(self, body: bytes) -> tuple[int, bytes, Any]:
        await asyncio.sleep(0.2)
        if body == b"later, broken":
            raise RuntimeError("the awaited answer broke")
        self.answered.append(len(body))
        return 202, orjson.dumps({"later": len(body)}), None


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers what the lane left: the body's length, and whether the lane declined it."""
    if scope["type"] != "http":
        return
    try:
        body = await read_body(Request(scope, receive), LIMIT)
        status, content = 200, orjson.dumps({"app": len(body), "declined": bool(scope.get("declined"))})
    except BodyTooLarge as e:
        status, content = 413, orjson.dumps({"Error": str(e)})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]})
    await send({"type": "http.response.body", "body": content})


@contextmanager
def lane_server(lane: EchoLane, header_timeout_s: float = 5.0) -> Iterator[int]:
    limits = ConnectionLimits(header_timeout_s=header_timeout_s, body_timeout_s=BODY_TIMEOUT_S, max_connections=32,
                              max_body_bytes=LIMIT)
    cfg = server_config(app, "api", "127.0.0.1", 0, log_level="warning", limits=limits, metrics=Metrics(),
                        keep_alive_s=5.0, lane=lane)
    server = uvicorn.Server(cfg)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started or not thread.is_alive(), 20, interval=0.01)
    assert server.started
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.fixture
def lane() -> EchoLane:
    return EchoLane()


@pytest.fixture
def port(lane: EchoLane) -> Iterator[int]:
    with lane_server(lane) as p:
        yield p


def request(path: str, body: bytes, *, version: str = "1.1", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


class Reader:
    """Responses off one socket, by their Content-Length."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def response(self) -> tuple[int, dict[str, str], Any]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict((k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
        size = int(headers["content-length"])
        while len(self.buf) < size:
            self._more()
        body, self.buf = self.buf[:size], self.buf[size:]
        return status, headers, orjson.loads(body)

    def closed(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        assert data, "connection closed"
        self.buf += data


def connect(port: int) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock, Reader(sock)


def test_claimed_requests_are_answered_by_the_lane_on_a_kept_connection(port: int, lane: EchoLane) -> None:
    sock, reader = connect(port)
    with sock:
        for n in (3, 5, 0):
            sock.sendall(request("/lane", b"x" * n))
            status, headers, body = reader.response()
            assert (status, body) == (200, {"lane": n})
            assert headers["content-type"] == "application/json" and "date" in headers
            assert "connection" not in headers
        sock.sendall(request("/other", b"abc"))
        assert reader.response()[2] == {"app": 3, "declined": False}
        sock.sendall(request("/lane", b"xy"))  # after the app's answer, the lane again
        assert reader.response()[2] == {"lane": 2}
    assert lane.answered == [3, 5, 0, 2]
    assert eventually(lambda: lane.follow_ups == [1, 2, 3, 4], 5)


def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/lane", b"a") + request("/other", b"bb") + request("/lane", b"ccc")
                     + request("/lane", b"decline") + request("/lane", b"dddd"))
        answers = [reader.response()[2] for _ in range(5)]
    assert answers == [{"lane": 1}, {"app": 2, "declined": False}, {"lane": 3}, {"app": 7, "declined": True},
                       {"lane": 4}]


def test_bodies_in_pieces_and_past_uvicorns_high_water_mark(port: int) -> None:
    sock, reader = connect(port)
    with sock:
        body = b"y" * 150_000  # over the 64 kB at which uvicorn pauses reading for the app
        raw = request("/lane", body)
        for i in range(0, len(raw), 7_001):
            sock.sendall(raw[i:i + 7_001])
            time.sleep(0.001)
        assert reader.response()[2] == {"lane": 150_000}
        sock.sendall(request("/lane", b"z"))
        assert reader.response()[2] == {"lane": 1}


def test_a_body_over_the_limit_goes_to_the_app_which_refuses_it(port: int, lane: EchoLane) -> None:
    sock, reader = connect(port)
    with sock:
        body = b"w" * (LIMIT + 1)
        sock.sendall(request("/lane", body))
        status, _, answer = reader.response()
    assert status == 413 and "exceeds" in answer["Error"]
    assert lane.answered == []


def test_what_the_lane_declines_or_fails_on_is_answered_by_the_app(port: int, lane: EchoLane) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/lane", b"decline this"))
        assert reader.response()[2] == {"app": 12, "declined": True}
        sock.sendall(request("/lane", b"raise"))
        assert reader.response()[2] == {"app": 5, "declined": False}
        sock.sendall(request("/lane", b"ok"))
        assert reader.response()[2] == {"lane": 2}


def test_a_request_waiting_for_100_continue_is_left_to_the_app(port: int, lane: EchoLane) -> None:
    sock, reader = connect(port)
    with sock:
        head = request("/lane", b"", extra="Expect: 100-continue\r\n").replace(b"Content-Length: 0",
                                                                              b"Content-Length: 4")
        sock.sendall(head)
        sock.settimeout(10)
        assert sock.recv(1 << 10).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"abcd")
        assert reader.response()[2] == {"app": 4, "declined": False}
    assert lane.answered == []


@pytest.mark.parametrize(("version", "extra"), [("1.1", "Connection: close\r\n"), ("1.0", "")])
def test_a_connection_that_is_not_kept_is_closed_after_the_answer(port: int, version: str, extra: str) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/lane", b"abc", version=version, extra=extra))
        status, headers, body = reader.response()
        assert (status, body, headers["connection"]) == (200, {"lane": 3}, "close")
        assert reader.closed()


def test_a_claimed_body_that_never_comes_meets_the_body_deadline(port: int, lane: EchoLane) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/lane", b"0123456789")[:-4])
        started = time.monotonic()
        assert reader.closed()
        assert time.monotonic() - started < BODY_TIMEOUT_S + 4
    assert lane.answered == []


def test_an_answer_the_lane_awaits_comes_in_turn_and_a_client_may_leave_before_it(port: int, lane: EchoLane) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/lane", b"later") + request("/lane", b"now") + request("/other", b"x"))
        assert [reader.response()[:3:2] for _ in range(3)] == [(202, {"later": 5}), (200, {"lane": 3}),
                                                               (200, {"app": 1, "declined": False})]
        sock.sendall(request("/lane", b"later, broken"))
        status, _, body = reader.response()
        assert status == 500 and "internal error" in body["Error"]
    gone, _ = connect(port)
    gone.sendall(request("/lane", b"later!"))
    gone.close()  # before its answer
    time.sleep(0.4)
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/lane", b"ok"))
        assert reader.response()[2] == {"lane": 2}
    assert lane.answered == [5, 3, 6, 2]


@pytest.mark.parametrize("path", ["/lane", "/app"])
def test_a_busy_connection_sending_whole_requests_outlives_the_head_deadline(lane: EchoLane, path: str) -> None:
    """Go's HTTP client sends a small POST's head and body in one write, so each request arrives whole in one read:
    the head deadline must start again at each answer, not run on from when the connection opened (kube-scheduler
    does not retry a POST that broke after it was written)."""
    header_timeout_s = 0.5
    with lane_server(lane, header_timeout_s=header_timeout_s) as port:
        sock, reader = connect(port)
        with sock:
            answered = 0
            end = time.monotonic() + 4 * header_timeout_s
            while time.monotonic() < end:
                sock.sendall(request(path, b"x" * 64))
                status, _, _ = reader.response()
                assert status == 200
                answered += 1
                time.sleep(0.02)
            assert answered > 20
            time.sleep(2 * header_timeout_s)  # idle past the deadline: now it is closed
            assert reader.closed()
