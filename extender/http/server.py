"""The extender's HTTP server: uvicorn, with the limits uvicorn lacks on what a client may hold.

Uvicorn (0.54) bounds idle keep-alive after a response, but not the time to send a request head or body, nor the
number of connections; on EMFILE asyncio logs the failed accept with its traceback once per queued connection, up to
the listen backlog, every second. Hypercorn has only a per-read idle timeout (a byte every few seconds keeps a head
open) and no connection cap; granian has a head timeout but no body timeout or connection cap, and runs the app in
worker processes of its own. So the server stays uvicorn, through its documented extension point (`http=`, the
protocol class), on uvicorn's httptools protocol (llhttp, the C parser of Node.js) and the uvloop event loop:
kube-scheduler's scheduling cycle waits for every /filter and /prioritize answer, and h11's pure-Python parsing and
the asyncio loop were a third of the serving process's time under bind load (issue 24). This module adds, per
listener:

- a head deadline: from when a connection is ready for a request (accepted, or its last response sent) to the end
  of the request's head; a body deadline: from the end of the head to the end of the body. A connection that misses
  one is closed (its request, if any, sees a disconnect). Idle keep-alive stays uvicorn's own `timeout_keep_alive`.
- a connection cap, below the process's open-files limit: a new connection past the cap evicts the connection that
  has waited longest for a request head (idle or slow: a client that sends its request quickly always gets in),
  else the one longest in sending a body, and is refused only when every connection is busy with an answer.
- running out of files at accept: libuv (under uvloop) handles it itself, closing the connections that wait in
  the backlog, without the busy retry and the log line per queued connection per second of asyncio's own loop;
  the cap keeps client connections below the limit, so it takes a leak elsewhere to get there.
- listening sockets bound before the app starts, so a busy port fails before anything says "started".
- a request the parser refuses is answered 400 with the parser's reason: among them both Transfer-Encoding and
  Content-Length (RFC 9112 6.3: its length is ambiguous, the classic request-smuggling shape), which llhttp refuses
  itself; and a chunk-size line announcing more than the body limit, refused at that line (the parser would
  otherwise wait for every byte it announced, 2^64-1 of them, until the body deadline).
- an answer's head held back until its body's first write, so that an answer leaves in one send (HeadWithBody).
- a second, read-only listener (metrics, probes) run beside the main one in the same loop (`serve_beside`).

Both binaries that serve HTTP use it: `gpu-extender serve` and `gpu-extender webhook`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import re
import resource
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar, NoReturn, Protocol

import click
import httptools
import structlog
import uvicorn
from prometheus_client import Counter, Gauge
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from extender.config import ListenerSettings

log = structlog.get_logger(__name__)

# Files the process needs besides client connections: listeners, API watches, logs, the interpreter's own.
FD_RESERVE = 64
# The listen backlog is also how many connections asyncio accepts in one go. An accepted connection reaches the
# cap's check (connection_made) two loop passes later, and one evicted for it is closed a pass after that, while
# every pass may accept another batch: the cap leaves ACCEPT_BATCHES backlogs of room below the files limit (with
# one, 300 connections against a 256-file limit ran out of files now and then). Under a small open-files limit the
# backlog shrinks with what is free (a quarter of it for the batches) rather than the cap collapsing.
BACKLOG = 64
MIN_BACKLOG = 8
ACCEPT_BATCHES = 3
# Fewer connections than MIN_CONNECTIONS and kube-scheduler's filter, prioritize and probes queue behind each other:
# the cap never goes below it. kube-scheduler also binds in the background, one HTTP call per pod (about 300 were
# seen in flight behind a backlog), so a limit that leaves fewer than WELL_SERVED_CONNECTIONS is warned about.
MIN_CONNECTIONS = 16
WELL_SERVED_CONNECTIONS = 320
HEAD, BODY = "head", "body"
# How much of a chunk-size line is kept to read the size from (the size comes first; extensions may follow).
CHUNK_LINE_BYTES = 64
# A request head that announces a chunked body (what on_headers_complete then reads from the parsed headers).
CHUNKED_HEAD = re.compile(rb"(?im)^transfer-encoding[ \t]*:[^\r\n]*chunked")


class HttpMetrics(Protocol):
    """What a listener counts (ExtenderMetrics and the webhook's metrics both carry these, on their own registry)."""

    http_connections: Gauge
    http_connections_closed: Counter


class ListenError(Exception):
    """A listening socket cannot be bound; the message names the address, `metrics` whether it was the read-only
    listener's."""

    def __init__(self, message: str, metrics: bool = False) -> None:
        super().__init__(message)
        self.metrics = metrics


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    backlog: int = BACKLOG
    max_body_bytes: int | None = None  # a chunked body announcing a larger chunk is refused at its size line


def open_files() -> tuple[int | None, int]:
    """The soft open-files limit (None when unlimited) and how many files the process has open now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    return (None if soft == resource.RLIM_INFINITY else soft), in_use


def connection_capacity(wanted: int, soft_limit: int | None, in_use: int) -> tuple[int, int]:
    """The connection cap and listen backlog for `wanted` connections under an open-files limit, so that client
    connections cannot exhaust it (accept would then fail): what is free past the reserve, less the accept batches,
    with the backlog scaled down under a small limit; never below MIN_CONNECTIONS unless fewer are wanted."""
    if soft_limit is None:
        return wanted, BACKLOG
    free = soft_limit - in_use - FD_RESERVE
    backlog = max(MIN_BACKLOG, min(BACKLOG, free // (4 * ACCEPT_BATCHES)))
    return min(wanted, max(MIN_CONNECTIONS, free - ACCEPT_BATCHES * backlog)), backlog


def connection_limits(settings: ListenerSettings, max_body_bytes: int, listener: str) -> ConnectionLimits:
    """A listener's limits from its settings and the process's open-files limit, warning at start when that limit
    leaves too few connections to serve kube-scheduler well."""
    soft, in_use = open_files()
    cap, backlog = connection_capacity(settings.max_connections, soft, in_use)
    if cap < min(settings.max_connections, WELL_SERVED_CONNECTIONS):
        log.warning("extender.server.few_connections", listener=listener, max_connections=cap,
                    wanted=settings.max_connections, open_files_limit=soft, files_in_use=in_use,
                    hint="the open-files limit (ulimit -n, or the container runtime's LimitNOFILE) is too low to "
                         "serve kube-scheduler's concurrent binds well; 1024 or more is enough")
    return ConnectionLimits(settings.header_timeout_s, settings.body_timeout_s, cap, backlog, max_body_bytes)


class Guard:
    """One listener's connections: its limits, which connections wait for a request head (and since when), and
    the metrics of what was closed."""

    def __init__(self, listener: str, limits: ConnectionLimits, metrics: HttpMetrics) -> None:
        self.listener = listener
        self.limits = limits
        self.waiting: dict[GuardedProtocol, float] = {}  # waiting for a request head, since when
        self.receiving: dict[GuardedProtocol, float] = {}  # receiving a request body, since when
        self._open = metrics.http_connections.labels(listener)
        self._closed = metrics.http_connections_closed

    def closed(self, reason: str) -> None:
        self._closed.labels(self.listener, reason).inc()

    def opened(self) -> None:
        self._open.inc()

    def lost(self) -> None:
        self._open.dec()

    def evict_one(self) -> bool:
        """Close the connection that has waited longest for a request head, else the one longest receiving a
        body; False when every connection is busy with an answer."""
        for phase in (self.waiting, self.receiving):
            if phase:
                min(phase, key=phase.__getitem__).expire("evicted")
                return True
        return False


class Refused(Exception):
    """A request refused by the protocol before the app sees it; the message is the 400 answer's text."""


class HeadWithBody:
    """One response cycle's view of its connection: the response head waits for the body's first write, so that an
    answer leaves in one send. Each send is a system call that also runs the loopback receive path; two per answer
    were a fifth of the serving process's time under bind load (py-spy, issue 24). A 100 Continue goes at once;
    HEAD requests, which write no body, are not wrapped."""

    __slots__ = ("_head", "_passing", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._head: bytes | None = None
        self._passing = False

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head, self._passing = self._head + data, None, True
        elif not self._passing and data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head = data
            return
        self.transport.write(data)

    def close(self) -> None:
        if self._head is not None:
            self.transport.write(self._head)
            self._head = None
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head and body deadlines, a connection cap and chunk sizes bounded by the
    body limit (see the module docstring)."""

    guard: ClassVar[Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._phase_cycle: object = None
        self._made = False
        self._chunked = False  # the request being received has a chunked body: its size lines are read
        self._line = b""  # the start of the chunk-size line being received (fed to the parser already)
        self._refusal: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        guard = self.guard
        if len(self.connections) >= guard.limits.max_connections and not guard.evict_one():
            guard.closed("refused")
            transport.abort()
            return
        self._made = True
        super().connection_made(transport)
        guard.opened()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._made:
            return  # refused at the cap: uvicorn never saw it
        self._made = False
        self._disarm()
        self.guard.lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            if self._chunked:
                self._feed_lines(data)
            elif self._phase == HEAD and (end := data.find(b"\r\n\r\n")) != -1 and end + 4 < len(data) \
                    and CHUNKED_HEAD.search(data, 0, end) is not None:
                # a chunked body behind its head: the head alone first, then the body line by line (any other
                # request, kube-scheduler's among them, is fed whole, without copying its body)
                self.parser.feed_data(data[:end + 4])
                rest = data[end + 4:]
                self._feed_lines(rest) if self._chunked else self.parser.feed_data(rest)
            else:
                self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no WebSocket here (ws="none"): answered as a plain request, as uvicorn does, without its warning
        except httptools.HttpParserError as e:
            self.send_400_response(self._refusal or f"invalid HTTP request: {e}")
            return
        self._follow()

    def _feed_lines(self, data: bytes) -> None:
        """Feed a chunked body a line at a time, so that on_chunk_header knows the size line it follows."""
        start = 0
        while self._chunked and (end := data.find(b"\n", start)) != -1:
            self._keep_line(data[start:end + 1])
            self.parser.feed_data(data[start:end + 1])
            self._line = b""
            start = end + 1
        if start < len(data):
            self._keep_line(data[start:])
            self.parser.feed_data(data[start:])

    def _keep_line(self, piece: bytes) -> None:
        if len(self._line) < CHUNK_LINE_BYTES:
            self._line = (self._line + piece)[:CHUNK_LINE_BYTES]

    def on_headers_complete(self) -> None:
        self._chunked = any(name == b"transfer-encoding" and b"chunked" in value.lower()
                            for name, value in self.headers)
        self._line = b""
        if self._phase == HEAD:
            self._disarm()  # the head came in time: the next head's deadline starts at its answer
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and self.scope.get("method") != "HEAD":
            cycle.transport = HeadWithBody(self.transport)  # type: ignore[assignment]

    def on_chunk_header(self) -> None:
        limit = self.guard.limits.max_body_bytes
        if limit is None or not self._chunked:
            return
        size_text = self._line.split(b";", 1)[0].strip()  # the line just fed (_feed_lines keeps it)
        try:
            size = int(size_text, 16)
        except ValueError:
            return  # the parser has accepted it: nothing of ours to check
        if size > limit:
            # the parser would wait for every byte announced (2^64-1: held until the body deadline)
            self._refusal = f"a chunk of {size} bytes exceeds the body limit of {limit} bytes"
            raise Refused(self._refusal)

    def on_message_complete(self) -> None:
        self._chunked = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    # -- deadlines ---------------------------------------------------------------------------------------------

    def _follow(self) -> None:
        """Arm the deadline of the phase the connection is in now; a phase keeps the deadline it started with."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            if self._phase != HEAD:
                self._arm(HEAD, self.guard.limits.header_timeout_s)
                self.guard.waiting[self] = time.monotonic()
        elif cycle.more_body and not cycle.disconnected:
            if self._phase != BODY or self._phase_cycle is not cycle:
                self._arm(BODY, self.guard.limits.body_timeout_s)
                self.guard.receiving[self] = time.monotonic()
                self._phase_cycle = cycle
        else:
            self._disarm()  # the request is complete: the app answers it

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self.expire, f"{phase}_timeout")

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = None
        self.guard.waiting.pop(self, None)
        self.guard.receiving.pop(self, None)

    def expire(self, reason: str) -> None:
        """Close the connection now (a deadline passed, or it is evicted); counted, not logged one by one."""
        self._disarm()
        self.guard.closed(reason)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


def protocol_class(guard: Guard) -> type[GuardedProtocol]:
    """The protocol class for one listener's uvicorn.Config(http=...)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host`:`port` (asyncio listens on it). Raises ListenError naming the address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def listeners(host: str, port: int, metrics_host: str, metrics_port: int
              ) -> tuple[socket.socket, socket.socket | None]:
    """The API listener and, with a metrics port, the read-only one, both bound before the app starts (a busy port
    fails before anything says "started"). Raises ListenError; the API socket is closed again when the metrics one
    cannot be bound."""
    sock = listen(host, port)
    if not metrics_port:
        return sock, None
    try:
        return sock, listen(metrics_host, metrics_port)
    except ListenError as e:
        close_quietly(sock)
        raise ListenError(str(e), metrics=True) from None


def listen_failed(error: ListenError) -> NoReturn:
    """How a serving command ends when a listener cannot be bound: click's error (exit 1) for the API port, exit
    3 for the metrics port."""
    if error.metrics:
        click.echo(f"Error: {error}", err=True)
        sys.exit(3)
    raise click.ClickException(str(error)) from None


def server_config(app: Any, listener: str, host: str, port: int, *, log_level: str, limits: ConnectionLimits,
                  metrics: HttpMetrics, keep_alive_s: float, lifespan: str = "off", **tls: Any) -> uvicorn.Config:
    """uvicorn's settings for one of our listeners: its guard, our backlog, no access log, uvicorn's own
    lines through our structured logging (gputopo.logs); `tls` are uvicorn's ssl_* settings."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None, access_log=False,
                          lifespan=lifespan, http=protocol_class(Guard(listener, limits, metrics)), loop="uvloop",
                          ws="none", proxy_headers=False,  # kube-scheduler calls it directly: no proxy to trust
                          backlog=limits.backlog,
                          timeout_keep_alive=keep_alive_s, **tls)  # type: ignore[arg-type]


def api_server_config(app: Any, config: Any, metrics: HttpMetrics, *, lifespan: str = "off") -> uvicorn.Config:
    """The API listener's settings from the extender's config (extender.config.ExtenderConfig): its limits, and
    HTTPS with client certificates required where a client CA is set."""
    mutual_tls = config.tls_client_ca is not None
    return server_config(
        app, "api", config.host, config.port, log_level=config.log_level,
        limits=connection_limits(config, config.max_body_bytes, "api"), metrics=metrics,
        keep_alive_s=config.keep_alive_timeout_s, lifespan=lifespan,
        ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
        ssl_ca_certs=str(config.tls_client_ca) if mutual_tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if mutual_tls else ssl.CERT_NONE,
    )


def close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def handing_over_server(config: uvicorn.Config, hand_over: Callable[[], None]) -> uvicorn.Server:
    """A uvicorn server that, on its first SIGTERM or SIGINT, keeps serving while `hand_over` runs (in a thread of
    its own), and only then shuts down as uvicorn does (in-flight requests answered, idle connections closed). A
    leader steps down and releases its Lease while its connections still answer (503 from then on), so none of
    kube-scheduler's calls in flight meets a closed connection and a standby takes over at once. A second signal
    shuts down without waiting."""

    class HandingOverServer(uvicorn.Server):
        handing_over = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.handing_over or self.should_exit:
                super().handle_exit(sig, frame)
                return
            self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
            self.handing_over = True
            threading.Thread(target=self._hand_over, name="extender-hand-over", daemon=True).start()

        def _hand_over(self) -> None:
            try:
                hand_over()
            except Exception:
                log.exception("extender.server.hand_over_failed")
            finally:
                self.should_exit = True

    return HandingOverServer(config)


# uvicorn's lines about the process rather than a listener: every uvicorn.Server logs them, so a companion beside
# the main server said "Started server process" a second time (and "Shutting down").
_PROCESS_LINES = frozenset({"Started server process [%d]", "Finished server process [%d]", "Shutting down"})
_IN_COMPANION: contextvars.ContextVar[bool] = contextvars.ContextVar("in_companion", default=False)


class _MainServerSpeaks(logging.Filter):
    """Drops the process lines a companion logs; the main server logs them once. The companion runs in a task of
    its own (serve_beside), whose context alone holds the mark."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_IN_COMPANION.get() and record.msg in _PROCESS_LINES)


_MAIN_SERVER_SPEAKS = _MainServerSpeaks()


def companion_server(config: uvicorn.Config) -> uvicorn.Server:
    """A uvicorn server that leaves the signals, and the process's start and finish lines, to the main server
    (serve_beside stops it)."""
    logging.getLogger("uvicorn.error").addFilter(_MAIN_SERVER_SPEAKS)  # uvicorn.server's logger; added once

    class CompanionServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            mark = _IN_COMPANION.set(True)
            try:
                await super().serve(sockets)
            finally:
                _IN_COMPANION.reset(mark)

    return CompanionServer(config)


async def serve_beside(main: uvicorn.Server, companion: uvicorn.Server | None,
                       sockets: list[socket.socket], companion_sockets: list[socket.socket]) -> None:
    """Run both servers in one loop on their bound sockets. The companion stops as soon as the main server begins
    to (a signal, a failed start); a companion that fails stops the main server and the process exits 3."""
    if companion is None:
        await main.serve(sockets=sockets)
        return
    failed: list[BaseException] = []

    async def run_companion() -> None:
        try:
            await companion.serve(sockets=companion_sockets)
        except (SystemExit, Exception) as e:
            failed.append(e)
            main.should_exit = True

    async def follow() -> None:
        while not main.should_exit and not task.done():
            await asyncio.sleep(0.1)
        companion.should_exit = True

    task = asyncio.create_task(run_companion())
    follower = asyncio.create_task(follow())
    try:
        await main.serve(sockets=sockets)
    finally:
        companion.should_exit = True
        await asyncio.gather(task, follower)
    if failed:
        log.error("extender.metrics.failed", error=str(failed[0]))
        raise SystemExit(3)
