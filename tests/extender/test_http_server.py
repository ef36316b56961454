"""The listener of extender.http.server (uvicorn with our guard) as a client sees it: a real server on 127.0.0.1 and
raw sockets, so keep-alive, pipelining, split and large bodies and the deadlines are what goes over the wire. The
limits against the real `gpu-extender serve` process are in test_http_limits, the one-send answers in
test_http_responses."""

from __future__ import annotations

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
        self.http_connections = Gauge("test_http_connections", "", ["listener"], registry=registry)
        self.http_connections_closed = Counter("test_http_connections_closed", "", ["listener", "reason"],
                                               registry=registry)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers the path and the body's length; 413 past LIMIT."""
    if scope["type"] != "http":
        return
    try:
        body = await read_body(Request(scope, receive), LIMIT)
        status, content = 200, orjson.dumps({"path": scope["path"], "length": len(body)})
    except BodyTooLarge as e:
        status, content = 413, orjson.dumps({"Error": str(e)})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]})
    await send({"type": "http.response.body", "body": content})


@contextmanager
def serving(header_timeout_s: float = 5.0) -> Iterator[int]:
    limits = ConnectionLimits(header_timeout_s=header_timeout_s, body_timeout_s=BODY_TIMEOUT_S, max_connections=32,
                              max_body_bytes=LIMIT)
    cfg = server_config(app, "api", "127.0.0.1", 0, log_level="warning", limits=limits, metrics=Metrics(),
                        keep_alive_s=5.0)
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
def port() -> Iterator[int]:
    with serving() as p:
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


def test_a_busy_connection_sending_whole_requests_outlives_the_head_deadline() -> None:
    """Go's HTTP client sends a small POST's head and body in one write, so each request arrives whole in one read:
    the head deadline must start again at each answer, not run on from when the connection opened (kube-scheduler
    does not retry a POST that broke after it was written)."""
    header_timeout_s = 0.5
    with serving(header_timeout_s=header_timeout_s) as port:
        sock, reader = connect(port)
        with sock:
            answered = 0
            end = time.monotonic() + 4 * header_timeout_s
            while time.monotonic() < end:
                sock.sendall(request("/filter", b"x" * 64))
                status, _, _ = reader.response()
                assert status == 200
                answered += 1
                time.sleep(0.02)
            assert answered > 20
            time.sleep(2 * header_timeout_s)  # idle past the deadline: now it is closed
            assert reader.closed()


def test_pipelined_requests_are_answered_in_order_on_a_kept_connection(port: int) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/a", b"x") + request("/b", b"yy") + request("/c", b""))
        answers = [reader.response() for _ in range(3)]
        sock.sendall(request("/d", b"zzz"))
        answers.append(reader.response())
    assert [body for _, _, body in answers] == [{"path": "/a", "length": 1}, {"path": "/b", "length": 2},
                                                {"path": "/c", "length": 0}, {"path": "/d", "length": 3}]
    assert all(status == 200 and "connection" not in headers for status, headers, _ in answers)


def test_bodies_in_pieces_past_uvicorns_high_water_mark_and_over_the_limit(port: int) -> None:
    sock, reader = connect(port)
    with sock:
        raw = request("/big", b"y" * 150_000)  # over the 64 kB at which uvicorn pauses reading for the app
        for i in range(0, len(raw), 7_001):
            sock.sendall(raw[i:i + 7_001])
            time.sleep(0.001)
        assert reader.response()[2] == {"path": "/big", "length": 150_000}
        sock.sendall(request("/small", b"z"))
        assert reader.response()[2] == {"path": "/small", "length": 1}
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/huge", b"w" * (LIMIT + 1)))
        status, _, answer = reader.response()
    assert status == 413 and "exceeds" in answer["Error"]


@pytest.mark.parametrize(("version", "extra"), [("1.1", "Connection: close\r\n"), ("1.0", "")])
def test_a_connection_that_is_not_kept_is_closed_after_the_answer(port: int, version: str, extra: str) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/x", b"abc", version=version, extra=extra))
        status, headers, body = reader.response()
        assert (status, body, headers["connection"]) == (200, {"path": "/x", "length": 3}, "close")
        assert reader.closed()


def test_a_body_that_never_comes_meets_the_body_deadline(port: int) -> None:
    sock, reader = connect(port)
    with sock:
        sock.sendall(request("/x", b"0123456789")[:-4])
        started = time.monotonic()
        assert reader.closed()
        assert time.monotonic() - started < BODY_TIMEOUT_S + 4
