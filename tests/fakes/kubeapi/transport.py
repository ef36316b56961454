"""HTTP/1.1 on 127.0.0.1 the way the kube-apiserver answers: its headers, Content-Length up to 2 KiB and chunked
above (as Go's net/http), chunked watch streams; a thread per connection, all shut down on stop."""

from __future__ import annotations

import contextlib
import email.utils
import socket
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import orjson

from tests.fakes.kubeapi.objects import Obj

if TYPE_CHECKING:
    from tests.fakes.kubeapi.server import FakeKubeApi

FLOWSCHEMA_UID = "0189922a-dd34-436b-b1b0-250896ff29e9"
PRIORITYLEVEL_UID = "a34983b7-6af4-4da5-8fee-55ff568bfebe"
MAX_CONTENT_LENGTH_BODY = 2048  # Go's net/http: bigger bodies go chunked


def shutdown_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Server(ThreadingHTTPServer):
    """Serves `fake`; stop() closes every open connection (watches included) and joins its thread."""

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
            shutdown_socket(conn)
        for thread in threads:
            thread.join(5)


class Handler(BaseHTTPRequestHandler):
    """One connection: every method goes to the fake's _serve; replies and watch chunks are written here."""

    protocol_version = "HTTP/1.1"
    server: Server
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

    def send_text(self, status: int, data: bytes) -> None:
        """A plain-text answer, as the apiserver's mux gives for a path nothing serves ("404 page not found")."""
        self.send_response_only(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Date", email.utils.formatdate(usegmt=True))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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
