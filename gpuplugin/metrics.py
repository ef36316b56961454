"""Prometheus metrics of the device plugin, on one registry, and the HTTP server for /metrics and /healthz.

One registry per plugin instance (not the process-global default) so that tests and benchmarks can run several
plugins in one process and read each one's figures.
"""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

# GetPreferredAllocation blocks pod admission; the target is p99 <= 2 ms, so resolve the low end finely.
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class PluginMetrics:
    """Every metric the plugin exports. Counter names get `_total` appended by prometheus-client."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.registrations = Counter(
            "gpuplugin_registrations", "Successful registrations with the kubelet.", registry=r
        )
        self.registration_failures = Counter(
            "gpuplugin_registration_failures", "Failed registration attempts with the kubelet.", registry=r
        )
        self.server_starts = Counter(
            "gpuplugin_server_starts", "Times the gRPC server started serving on its socket.", registry=r
        )
        self.allocations = Counter(
            "gpuplugin_allocations", "Allocate container requests, by result (ok, invalid).", ["result"], registry=r
        )
        self.plan_hits = Counter(
            "gpuplugin_preferred_plan_hits", "Preferred allocations answered with a scheduler plan.", registry=r
        )
        self.preferred_fallbacks = Counter(
            "gpuplugin_preferred_fallbacks",
            "Preferred allocations answered without a plan, by reason.",
            ["reason"],
            registry=r,
        )
        self.preferred_latency = Histogram(
            "gpuplugin_preferred_allocation_seconds",
            "Time to answer one GetPreferredAllocation call.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.health_transitions = Counter(
            "gpuplugin_health_transitions", "Device health changes, by new state.", ["to"], registry=r
        )
        self.devices = Gauge("gpuplugin_devices", "Advertised devices, by health.", ["health"], registry=r)


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every few seconds would flood the structured log."""


class MetricsServer:
    """/metrics (Prometheus text) and /healthz (200 when `ready()` is true, else 503) on one port.

    `port=0` binds an ephemeral port (read it from `.port`); the CLI maps its `--metrics-port 0` to "no server".
    """

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool], port: int, host: str = "") -> None:
        self._metrics_app = make_wsgi_app(registry)
        self._ready = ready
        self._server = make_server(host, port, self._app, _ThreadingWSGIServer, handler_class=_QuietHandler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            ok = self._ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not serving or not registered\n"]
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
